//! Configuration of `semlb serve`: a TOML file, command-line flags over it,
//! and validation.
//!
//! The code: this module holds the top level (the keys, [`ServeConfig`],
//! loading and the flags); `backend.rs` the `[[backend]]` table and its URL;
//! `models.rs` the `[[model]]` pools; `model_changes.rs` the pools the admin API changed (`admin.models_file`, merged over them); `sections.rs` the optional sections (`[response_cache]`, `[store]`,
//! `[limits]`, `[health]`, `[admin]`); `validate.rs` [`ServeConfig::validate`];
//! `tests.rs` the tests.
//!
//! # Sources and precedence
//!
//! Defaults < the file < flags. [`ServeConfig::load`] reads the file (no
//! file: the defaults), [`ServeConfig::apply`] puts the flags
//! ([`ServeOverrides`]) over it, and [`ServeConfig::validate`] checks the
//! result; [`ServeConfig::resolve`] does all three. `--backend` replaces the
//! file's whole `[[backend]]` list rather than adding to it, so a command
//! line always says exactly which servers are used.
//!
//! Every table rejects keys it does not know, so a misspelt key is an error
//! rather than a silently ignored setting; parse errors come from the TOML
//! parser and name the key, the line and the column, with the line quoted.
//! Relative `tokenizer` and `chat_template` paths in a file are relative to
//! the file's directory (a service's working directory is usually `/`);
//! relative paths given as flags are relative to the working directory, as
//! usual. `systemd/semlb.toml` is a commented example with every key.
//!
//! # Keys
//!
//! | key | type | default | meaning |
//! | --- | --- | --- | --- |
//! | `listen` | `"ip:port"` | `"0.0.0.0:8080"` | where the dispatchers accept OpenAI-compatible HTTP |
//! | `dispatchers` | integer | CPU cores, at most 64 | dispatcher processes (1 to 64: one completion ring each) |
//! | `responders` | integer | `1` | response (write-back) processes (1 to `dispatchers`) |
//! | `shm_name` | string | `"semlb"` | shared-memory segment name (`/dev/shm/NAME`) |
//! | `shm_size` | size | `"256MiB"` | segment size, 8 MiB to 1 TiB (see [`crate::config::size`]) |
//! | `keep_segment` | bool | `true` (`false` with `--demo`) | leave the segment in /dev/shm when the supervisor exits, so the next start adopts its tables (hot restart); `false` removes it on a clean stop |
//! | `tokenizer` | path | bundled tokenizer | a Hugging Face `tokenizer.json`, or a GGUF model file (the engine's own: its vocabulary and merges, [`semlb_tokenizer::gguf`]) |
//! | `chat_template` | path | a GGUF `tokenizer`'s template, else the canonical rendering | a Hugging Face `tokenizer_config.json` with a `chat_template`, or a GGUF model file |
//! | `block_size` | integer | `16` | tokens per prefix block: the engines' KV block size (1 to 1024) |
//! | `segment_cache_size` | size | `"32MiB"` | per dispatcher: token ids of text segments already seen (earlier turns, shared system prompts), so they are not tokenized again; `0` turns it off (at most 16 GiB) |
//! | `learn_at_dispatch` | bool | `true` | record a prompt's blocks for its server when it is sent, and credit a conversation's next turn with the answer not yet written back ([`crate::prefix::continuation`]); `false` leaves learning to the response processes alone |
//! | `learn_from_reports` | bool | `true` | set aside a server's prefix entries older than an eviction its engine reports (its horizon), forget a server in every prefix entry when its engine reports a lost cache or restarts ([`crate::responder`], [`crate::health`]); `false` only counts what engines report |
//! | `stream_usage` | bool | `true` | ask engines for the usage of a streamed answer whose client did not (`stream_options.include_usage`), to read the prompt tokens they found cached, and take it out of what the client gets; `false` relays such streams untouched, and they report nothing |
//! | `drain_timeout_secs` | integer | `30` | on SIGTERM, how long requests in flight may still run |
//! | `[[backend]]` | table, repeated | none (required) | one inference server each, at most 128 |
//! | `backend.url` | string | required | `http://host:port`, no path |
//! | `backend.name` | string | `host:port` | name in logs and metrics (`A-Z a-z 0-9 . _ : -`, at most 64 bytes) |
//! | `backend.metrics_flavor` | `auto`, `vllm`, `sglang`, `llamacpp` | `auto` | how its `/metrics` is read; `auto` tells from the metric names |
//! | `backend.cache_salt` | bool | `false` | its engine takes vLLM's `cache_salt`: requests of tenants with `isolate_prefixes` carry their salt to it |
//! | `backend.role` | `both`, `prefill`, `decode` | `both` | its part in disaggregated serving ([`disaggregation`]): a `prefill` engine gets only prefill legs, a `decode` engine the requests and their decode legs |
//! | `backend.bootstrap_port` | integer | its `/server_info`, else 8998 | SGLang: the port of a prefill engine's bootstrap server (`--disaggregation-bootstrap-port`) |
//! | `backend.weight` | integer, 1 to 1000 | `1` | its capacity relative to the others': the routing policies compare loads per unit of weight ([`crate::routing::Candidate::per_weight`]) |
//! | `[pd]` | table | | disaggregated serving, for pools with `prefill` backends and backends that decode |
//! | `pd.protocol` | `vllm-nixl`, `sglang` | `vllm-nixl` | how the two legs are driven: vLLM's NixlConnector (prefill, then decode with its `kv_transfer_params`) or SGLang's bootstrap rendezvous (both at once) |
//! | `pd.bypass_uncached_tokens` | integer | `256` | a request whose decode engine already holds all but at most this many prompt tokens goes to it alone |
//! | `pd.prefill_timeout_secs` | integer | `60` | how long a prefill leg may take (1 to 3600) |
//! | `pd.decode_by` | `load`, `policy` | `load` | how the decode engine is chosen: by load with the prompt it holds breaking ties ([`crate::routing::decode_leg`]), or by the pool's policy |
//! | `[discovery]` | table | not set | backends found at run time: `kind` (`file`, `kubernetes`, `inference-pool`) and what it reads ([`discovery`], [`crate::discovery`]) |
//! | `[[model]]` | table, repeated | none: one pool of every backend, any model name | a model pool: `name`, `aliases`, `backends`, `base` (LoRA adapters), `tokenizer`, `chat_template`, `block_size`, `[model.policy]` ([`models`]) |
//! | `[policy]` | table | | the routing policy, [`crate::routing::PolicyConfig`] |
//! | `[peering]` | table | | this gateway as a region among peer gateways ([`crate::peers`]; `peers.rs`) |
//! | `peering.region` | string | not set | this gateway's region name; required with `[[peer]]` or `peering.token_file` |
//! | `peering.token_file` | path | not set | the token peers present to read this gateway's load (`GET /semlb/peer/load`); not set: not served |
//! | `peering.poll_ms` | integer | `250` | how often each dispatcher asks each peer for its load |
//! | `peering.max_age_ms` | integer | `1500` | a peer's load older than this is not used |
//! | `peering.forward_after_ms` | integer | `500` | forward only when the local queue's expected wait exceeds this (and the peer's round trip) |
//! | `peering.delay_penalty_ms` | integer | `200` | a round trip this long costs a peer as much as all its free servers, when peers are ranked |
//! | `[[peer]]` | table, repeated | none | another region's gateway: `url` (`http://` or `https://`), `region`, `token_file` (what it expects), `delay_ms` (added latency, for tests); over `https://`, `ca_file` (default: the system's roots), `cert_file` and `key_file` (a client certificate) |
//! | `[tls]` | table | not set: plain HTTP | the listener serves HTTPS: `cert_file`, `key_file` (PEM, the key mode 0600), `client_ca_file` (mutual TLS: clients must present a certificate of this CA); the `tls` module |
//! | `policy.kind` | `cache_aware`, `least_load`, `round_robin`, `random`, `selective_push`, `consistent_hash`, `dual_map`, `weighted_scorers`, `cost` | `cache_aware` | which policy ([`crate::routing`]) |
//! | `[policy.queue]` | table | | the gateway queue of `selective_push` and `dual_map` ([`crate::routing::QueueParams`]) |
//! | `policy.queue.capacity` | integer | `1024` | requests waiting at the gateway, all dispatchers together (1 to 1 000 000); one more gets 503 with `Retry-After` |
//! | `policy.queue.max_wait_ms` | integer | `60000` | a request waiting longer gets 503 (1 ms to 1 hour) |
//! | `policy.queue.recheck_ms` | integer | `5` | how often queued requests are looked at again without a local signal (1 to 1000) |
//! | `policy.queue.fair_share` | bool | `true` | among the waiting requests of a class, the tenant that has received the least service first ([`crate::tenancy::fair_share`]); `false`: oldest first |
//! | `policy.queue.batch_max_delay_ms` | integer | `10000` | a batch request waiting this long goes before interactive ones (1 ms to 1 hour) |
//! | `[policy.cache_aware]` | table | | thresholds of the `cache_aware` policy, checked whatever the kind ([`crate::routing::cache_aware::CacheAwareParams`]) |
//! | `policy.cache_aware.cache_threshold` | float | `0.3` | share of the prompt's blocks (0 to 1) a server must hold, strictly more than, to get the request for its cache |
//! | `policy.cache_aware.balance_abs_threshold` | integer | `32` | the prefix winner is overloaded only if it has more than this many requests in flight above the least busy server ... |
//! | `policy.cache_aware.balance_rel_threshold` | float | `1.1` | ... and more than this multiple (at least 1) of its load; then the least loaded server gets the request |
//! | `policy.cache_aware.scale_to_capacity` | bool | `true` | the absolute threshold is at most an eighth of what the winner's engine runs at once, rounded up: its reported slots (llama.cpp's `/props`), else its learned admission limit, else 8 (`scale_to_engine_slots`, the old name, is still read) |
//! | `policy.cache_aware.weigh_queued_prefill` | bool | `true` | the winner also loses the request when the prefill work queued there (uncached prompt tokens without a first token yet) beyond the least queued server is more than its cache saves (and than `queued_prefill_margin`), and the fallback is the server with the least work queued ahead of the request (pending prefill tokens, 16 per decoding request), then the fewest in flight; `false`: SGLang's rules |
//! | `policy.cache_aware.queued_prefill_margin` | integer | `2048` | queued prefill tokens beyond the least queued server that never move a request from its cache (one prefill step of a vLLM engine) |
//! | `policy.cache_aware.fallback_weighs_own_prefill` | bool | `true` | with `weigh_queued_prefill`, the fallback also counts the prefill the request would bring to each server (its prompt past what the server holds, the shared header included), so a new conversation goes where its system prompt is warm unless the work queued there exceeds the others' by more than recomputing it |
//! | `policy.cache_aware.saved_tokens_per_spread` | integer | `512` | tokens of a conversation's own cache (its match past the shared header) per request of extra load spread its server may carry before the request moves, up to `balance_abs_threshold`; 0: the spread alone decides |
//! | `[policy.selective_push]` | table | | SkyLB's selective pushing ([`crate::routing::selective_push`]) |
//! | `policy.selective_push.mode` | `pending`, `unstarted`, `max_outstanding` | `pending` | when a server is full: estimated pending requests (scraped queue, tracked by the gateway) above `max_pending`; or requests without a first token above `max_pending` (strict); or `max_outstanding` requests in flight |
//! | `policy.selective_push.max_pending` | integer | `0` | pending requests (sent, no first token; scraped `waiting` corrected by the gateway's accounting) a server may have and still take more |
//! | `policy.selective_push.max_outstanding` | integer | `32` | requests in flight that make a server full in mode `max_outstanding` (1 to 1 000 000) |
//! | `policy.selective_push.cache_wait_ms` | integer | `2000` | how long a request whose conversation's engine (the longest prefix past the shared header, not overloaded by the balance rule) is full waits for it in the gateway queue before it may go to another free server (0 to 3 600 000; 0: SkyLB's rule, any free server, the longest prefix among them first) |
//! | `[policy.consistent_hash]` | table | | session-key consistent hashing ([`crate::routing::consistent_hash`]) |
//! | `policy.consistent_hash.key_headers` | array of strings | `["x-session-id", "x-user-id"]` | headers carrying the session key, tried in order |
//! | `policy.consistent_hash.user_field` | boolean | `true` | then the body's `user` field |
//! | `policy.consistent_hash.conversation_key` | boolean | `true` | then, for a chat, its opening: the messages up to and including the first user message |
//! | `policy.consistent_hash.fallback_prefix_blocks` | integer | `8` | without a key: hash this many leading blocks of the prompt |
//! | `policy.consistent_hash.virtual_nodes` | integer | `100` | points per server on the ring (1 to 10 000) |
//! | `policy.consistent_hash.bounded_load` | boolean | `true` | skip servers above `(1 + load_epsilon)` × the average load |
//! | `policy.consistent_hash.load_epsilon` | float | `0.25` | the bound's slack (0 to 100) |
//! | `[policy.dual_map]` | table | | two-choice prefix mapping ([`crate::routing::dual_map`]) |
//! | `policy.dual_map.min_prefix_blocks` | integer | `4` | shortest hashed prefix, in blocks, and the step by which a hot one is extended |
//! | `policy.dual_map.max_prefix_blocks` | integer | `4096` | longest hashed prefix, in blocks (at least `min_prefix_blocks`) |
//! | `policy.dual_map.hot_share` | float | `0.0` | share of recent requests above which a prefix is hot and the hash extends past it; 0 = `1 / servers` |
//! | `policy.dual_map.window` | integer | `1024` | requests between halvings of the hotness counts |
//! | `policy.dual_map.ttft_slo_ms` | integer | `2000` | the TTFT objective: a better cache match that would break it yields to the other candidate; a request that waited this long for its two full candidates goes to the least loaded free server |
//! | `policy.dual_map.prefill_tokens_per_sec` | float | `10000` | the engines' prefill speed, for the TTFT estimate |
//! | `policy.dual_map.max_pending` | integer | `0` | a candidate is full above this many pending requests (then rebalance or wait) |
//! | `policy.dual_map.virtual_nodes` | integer | `100` | points per server on each of the two rings |
//! | `[policy.weighted_scorers]` | table | | llm-d-style weighted scoring ([`crate::routing::weighted_scorers`]) |
//! | `policy.weighted_scorers.prefix_weight` | float | `3` | weight of the prefix-match score |
//! | `policy.weighted_scorers.queue_weight` | float | `1` | weight of the queue (pending) score |
//! | `policy.weighted_scorers.kv_cache_weight` | float | `1` | weight of the KV-cache usage score |
//! | `policy.weighted_scorers.load_weight` | float | `1` | weight of the in-flight load score |
//! | `policy.weighted_scorers.pick` | `max`, `weighted_random` | `max` | the best score, or a draw weighted by score |
//! | `[policy.cost]` | table | | prefill-token cost with a weight tuned online ([`crate::routing::cost`]) |
//! | `policy.cost.initial_weight` | float | `0.0625` | weight of queued work against uncached prompt tokens to start from (1/16 to 16) |
//! | `policy.cost.tune` | bool | `true` | tune the weight online from TTFT |
//! | `policy.cost.explore` | float | `0.05` | share of epochs routed with another weight (0 to 0.5) |
//! | `policy.cost.epoch_requests` | int | `32` | requests per epoch: an epoch's requests share one weight and are its evidence together; one that changes the weight adds half an epoch of washout (1 to 4096) |
//! | `policy.cost.running_request_tokens` | integer | `16` | prefill tokens one decoding request counts as queued work |
//! | `policy.cost.bounded_load` | boolean | `true` | skip servers above `(1 + load_epsilon)` × the average requests in flight |
//! | `policy.cost.load_epsilon` | float | `0.25` | the bound's slack (0 to 100) |
//! | `[policy.prefix]` | table | | the prefix matches the prefix-aware policies see ([`crate::routing::PrefixParams`]) |
//! | `policy.prefix.source` | `estimate`, `precise` | `estimate` | the table the gateway builds from what it sent, or the engines' KV events where followed ([`crate::kv_events`]) |
//! | `policy.prefix.confirm_window_secs` | integer | `2` | with `precise`: how long the gateway's own entries count before an engine confirms them (1 to 60) |
//! | `policy.prefix.shared_headers` | bool | `true` | a match that ends at a shared header (a prefix more than two other recent prompts diverged right after: a system prompt) counts as none, so such prompts go by load ([`crate::routing::shared_header`]) |
//! | `[response_cache]` | table | | the exact-response cache |
//! | `response_cache.enabled` | bool | `true` | answer repeated deterministic requests from the cache |
//! | `response_cache.ttl_secs` | integer | `300` | how long a cached response is served (1 s to 1 year) |
//! | `response_cache.scope` | `tenant`, `global` | `tenant` | who shares cached responses: callers with the same API key, or everyone |
//! | `response_cache.max_value_fraction` | float | `0.125` | largest share of the response log one response may take, in (0, 0.5] |
//! | `response_cache.cache_nondeterministic` | bool | `false` | also cache requests that sample (`temperature` > 0, no `seed`) |
//! | `[resume]` | table | | streams resumed on another engine when theirs breaks mid-answer ([`crate::dispatcher::resume`]) |
//! | `resume.enabled` | bool | `true` | resume a chat completions stream whose engine dies, stalls or sends an error event after the first byte |
//! | `resume.max_attempts` | integer | `2` | resumptions of one answer at most (0 to 10); past them the client gets an error event and `data: [DONE]` |
//! | `resume.stall_ms` | integer | `30000` | a stream that sends nothing for this long after its first byte is broken (0: never; else at least 100) |
//! | `[sessions]` | table | | agent sessions kept on their engines by the prefix-aware policies ([`crate::routing::affinity`]) |
//! | `sessions.enabled` | bool | `true` | read a request's session key and keep its session on its engine while the load rule allows |
//! | `sessions.headers` | array of strings | `["x-session-id", "x-session-affinity"]` | headers carrying the session key, tried in order |
//! | `sessions.fields` | array of strings | `["prompt_cache_key", "metadata.user_id", "safety_identifier", "user"]` | then body fields (a dotted name is nested), tried in order |
//! | `[store]` | table | | where the routing state lives ([`crate::store`]) |
//! | `store.kind` | `shm`, `redis` | `shm` | the host's shared-memory segment, or a Redis server (shared by every host using it) |
//! | `[store.redis]` | table | | the Redis store, used when `kind = "redis"` (checked whatever the kind) |
//! | `store.redis.url` | string | `"redis://127.0.0.1:6379/"` | `redis://host:port[/db]`, `rediss://` for TLS; a `user:password@` still works, but see `password_file` |
//! | `store.redis.username` | string | none | an ACL user (Redis 6+), if not in the URL |
//! | `store.redis.password_file` | path | none | a file only its owner may read whose first line is the password; else `$SEMLB_REDIS_PASSWORD`. Never on a child's command line or in a log |
//! | `store.redis.ca_file` | path | the system's roots | a PEM certificate authority a `rediss://` server's certificate is checked against |
//! | `store.redis.namespace` | string | `"semlb"` | prefix of every key (`A-Z a-z 0-9 . _ : -`, at most 64 bytes): deployments sharing a Redis must differ |
//! | `store.redis.prefix_ttl_secs` | integer | `3600` | a prefix entry expires this long after its last refresh (1 s to 1 year) |
//! | `store.redis.timeout_ms` | integer | `100` | connect and reply deadline; slower is an outage (1 ms to 60 s) |
//! | `store.redis.retry_ms` | integer | `1000` | during an outage, how often Redis is probed again (10 ms to 60 s) |
//! | `store.redis.lookup` | `script`, `naive` | `script` | longest-prefix lookup in one round trip, or one per block (the paper's baseline, for comparison) |
//! | `store.redis.write_backlog` | integer | `10000` | completion records a response process keeps to write once Redis is back (0 to 1 M) |
//! | `[limits]` | table | | request limits |
//! | `limits.max_body_bytes` | size | `"16MiB"` | largest request body accepted (larger: 413) |
//! | `limits.request_timeout_secs` | integer | `600` | whole-request deadline towards a backend (1 s to 1 day) |
//! | `limits.connect_timeout_ms` | integer | `2000` | TCP connect deadline to a backend (at most the request timeout) |
//! | `limits.retries` | integer | `2` | other backends tried when one cannot be reached, before any byte was answered (0 to 10) |
//! | `limits.client_timeout_secs` | integer | `30` | how long a client may take to send its headers or its body (408), or leave an answer unread (the connection is closed and the engine released); 1 to 3600 |
//! | `limits.max_connections` | integer | `4096` | client connections per dispatcher; one more gets 503 and is closed (1 to 1 000 000) |
//! | `limits.max_connections_per_ip` | integer | `0` (no cap) | client connections per dispatcher from one IP address; one more gets 503 and is closed (leave 0 behind a load balancer, which all clients share the address of) |
//! | `limits.max_inflight_body_bytes` | size | `"256MiB"` | request bodies one dispatcher holds at once (read, parsed, routed); a body past it gets 503 `server_busy` with `Retry-After: 1` (at least `max_body_bytes`) |
//! | `limits.max_messages` | integer | `4096` | most messages in a chat request (more: 400 `array_above_max_length` before rendering) |
//! | `limits.max_prompt_bytes` | size | `"8MiB"` | largest prompt text, rendered chat or completions prompt (larger: 413 `prompt_too_large` before tokenizing) |
//! | `auth.tenant_share_percent` | integer | `50` | with more than one tenant in the keys file, the most of the prefix table's slots and of the response cache's entries one tenant may fill in ten minutes; past it its prompts are routed but not learned or cached (100: no bound) |
//! | `limits.reserve_output_tokens` | integer | `4096` | output tokens a request without `max_tokens` reserves in its `tokens_per_minute` buckets per answer (at most what the largest live context leaves), settled when the answer ends ([`crate::tenancy::rate_limit`]) |
//! | `limits.check_context` | bool | `true` | a request no live engine's context can take (their `max_model_len`, llama.cpp's slot context) gets the engines' 400 `context_length_exceeded` from the gateway, once every live engine has said its context |
//! | `[health]` | table | | health checks and load scraping of the backends ([`crate::health`]) |
//! | `health.path` | string | `"/health"` | path of the active health check (`GET`; any 2xx is healthy) |
//! | `health.interval_ms` | integer | `2000` | time between health checks of a server, also while it is down (10 ms to 1 hour) |
//! | `health.timeout_ms` | integer | `1000` | deadline of one health check or scrape (1 ms to `interval_ms`) |
//! | `health.unhealthy_threshold` | integer | `3` | consecutive failures (checks, or requests when `passive`) that take a server out (1 to 100) |
//! | `health.healthy_threshold` | integer | `2` | consecutive successful checks that bring a server that is down back (1 to 100) |
//! | `health.scrape_interval_ms` | integer | `1000` | time between reads of a server's Prometheus `/metrics` (10 ms to 1 hour) |
//! | `health.stale_after_ms` | integer | `5000` | scraped load figures older than this are ignored (`scrape_interval_ms` to 1 day) |
//! | `health.passive` | bool | `true` | count failed requests (connection errors, 5xx, cut bodies) towards `unhealthy_threshold` |
//! | `[admin]` | table | | the admin API (`semlb serve`'s supervisor serves it) |
//! | `admin.listen` | `"ip:port"` | not set: no admin API | where the admin API accepts HTTP; keep it on loopback or a management network |
//! | `admin.token` | string | not set | the bearer token every admin request must send (16 to 4096 visible ASCII characters); required with `listen`, or `token_file` |
//! | `admin.token_file` | path | not set | a file holding the token instead (trailing whitespace ignored); it must not be readable by others (`chmod 0600`) |
//! | `admin.models_file` | path | not set: pools change by reload only | where the admin API keeps the model pools it added, changed or removed ([`ModelChanges`]); merged over the `[[model]]` tables at every start and reload; its directory must be writable by semlb |
//! | `[auth]` | table | | client authentication ([`crate::tenancy::auth`]) |
//! | `auth.debug_headers` | bool | false | authenticated callers get the diagnostic `x-semlb-*` answer headers (`-backend`, `-route`, `-cache`, `-dispatch-ns`, `-queue-ms`, a peer's `-peer`) (they name internal addresses and tell whether another tenant recently sent the same prefix or line); without `[auth]` they are always sent. Read when a dispatcher starts |
//! | `auth.keys_file` | path | not set: no authentication | the keys file `semlb keys` writes (SHA-256 digests of the keys, a tenant and the models each may use); every `/v1/...` request then needs a listed key (401, 403 for a model it may not use). Re-read on reload |
//! | `[metrics]` | table | | where Prometheus scrapes the gateway |
//! | `metrics.listen` | `"ip:port"` | not set: `/metrics` on `listen` | a listener of its own for `GET /metrics` (the supervisor serves it); the gateway's `listen` then answers `/metrics` with 404, so clients never see it |
//! | `metrics.token_file` | path | not set | a file (mode 0600) holding the bearer token a scrape of `/metrics` on `listen` must present; with `[auth]` and neither this nor `metrics.listen`, `/metrics` on `listen` answers 404 (tenants' usage and engine addresses are not for clients) |
//! | `[epp]` | table | | the Gateway API Inference Extension's endpoint picker |
//! | `epp.listen` | `"ip:port"` | not set: no picker | every dispatcher also serves Envoy's external processing (`envoy.service.ext_proc.v3`) and `grpc.health.v1` on this address ([`crate::dispatcher::epp`]) |
//!
//! Sizes are strings such as `"256MiB"`, `"1.5GiB"` or `"100MB"`, or an
//! integer number of bytes.
//!
//! # Flags
//!
//! [`ServeOverrides`] has one field per flag: `--listen`, `--dispatchers`,
//! `--responders`, `--shm-name`, `--shm-size`, `--backend URL`,
//! `--prefill URL` and `--decode URL` (repeatable), `--pd-protocol`, `--tokenizer`, `--chat-template`, `--block-size`,
//! `--policy`, `--store`, `--redis-url`, `--redis-namespace`,
//! `--redis-lookup`, `--admin-listen`, `--metrics-listen`, `--epp-listen` and `--admin-token-file` (which
//! replaces a file's `admin.token`).

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use shm_layout::plan::{MAX_SEGMENT_BYTES, MIN_SEGMENT_BYTES, PROCESS_SLOTS, RING_COUNT, SERVER_SLOTS};

use crate::config::size::ByteSize;
use crate::routing::{PolicyConfig, PolicyKind};

mod backend;
pub mod disaggregation;
pub mod discovery;
mod model_changes;
pub mod models;
mod peers;
mod sections;
pub mod size;
#[cfg(test)]
mod tests;
mod validate;

pub use backend::{BackendConfig, BackendError, BackendUrl, BackendUrlError, MAX_WEIGHT, MetricsFlavor};
pub use disaggregation::{BackendRole, DecodeBy, PdConfig, PdProtocol};
pub use discovery::{DiscoveryConfig, DiscoveryKind};
pub use model_changes::ModelChanges;
pub use models::{ModelConfig, ModelError};
pub use peers::{MAX_PEERS, PeerConfig, PeerTls, PeeringConfig};
pub use sections::*;

/// Default `listen` address.
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::UNSPECIFIED), 8080);
/// Default `shm_name`.
pub const DEFAULT_SHM_NAME: &str = "semlb";
/// Default `shm_size`: 256 MiB (about 7.85 M prefix slots and a 118 MiB
/// response log; see [`shm_layout::plan`]).
pub const DEFAULT_SHM_SIZE: ByteSize = ByteSize(256 << 20);
/// Default `block_size`, in tokens (see [`ServeConfig::block_size`]).
pub use crate::prefix::blocks::DEFAULT_BLOCK_SIZE;
/// Largest `block_size` accepted.
pub const MAX_BLOCK_SIZE: usize = 1024;
/// Default `segment_cache_size` (see [`ServeConfig::segment_cache_size`]).
pub const DEFAULT_SEGMENT_CACHE_SIZE: ByteSize = ByteSize(32 << 20);
/// Largest `segment_cache_size` accepted.
pub const MAX_SEGMENT_CACHE_SIZE: ByteSize = ByteSize(16 << 30);
/// Most dispatchers: one completion ring each ([`RING_COUNT`]).
pub const MAX_DISPATCHERS: usize = RING_COUNT as usize;
/// Most backends: the server table's slots ([`SERVER_SLOTS`]).
pub const MAX_BACKENDS: usize = SERVER_SLOTS as usize;
/// Longest backend `name`, in bytes.
pub const MAX_BACKEND_NAME_BYTES: usize = 64;
/// Longest `response_cache.ttl_secs`: one year.
pub const MAX_TTL_SECS: u64 = 365 * 24 * 3600;
/// Longest `limits.request_timeout_secs` and `drain_timeout_secs`: one day.
pub const MAX_TIMEOUT_SECS: u64 = 24 * 3600;
/// Most `limits.retries`.
pub const MAX_RETRIES: u32 = 10;
/// Longest `limits.client_timeout_secs`: one hour.
pub const MAX_CLIENT_TIMEOUT_SECS: u64 = 3600;
/// Most `limits.max_connections` (per dispatcher).
pub const MAX_CONNECTIONS: u32 = 1_000_000;
/// Shortest admin bearer token, in bytes.
pub const MIN_ADMIN_TOKEN_BYTES: usize = 16;
/// Longest admin bearer token, in bytes.
pub const MAX_ADMIN_TOKEN_BYTES: usize = 4096;

/// Why a configuration could not be loaded or is not usable. Every message
/// names the file or the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read configuration file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// The file is not valid TOML or does not fit the schema (unknown key,
    /// wrong type, bad size...).
    #[error("invalid configuration file {}: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The TOML parser's message: what is wrong, with the line and
        /// column, the line quoted and the key marked.
        message: String,
    },
    /// A value is out of range or inconsistent with another.
    #[error("invalid configuration: {field} = {value}: {reason}")]
    Invalid {
        /// The key as written in the file, with its table
        /// (`limits.retries`; `backend[1].url` counts the `[[backend]]`
        /// tables from 0).
        field: String,
        /// The offending value, as TOML would write it.
        value: String,
        /// Why it is refused.
        reason: String,
    },
}

impl ConfigError {
    /// `field = value` is refused for `reason` (a message, or the typed
    /// error of the check that refused it, kept as its message).
    pub(crate) fn invalid(field: impl Into<String>, value: impl fmt::Display, reason: impl fmt::Display) -> Self {
        Self::Invalid {
            field: field.into(),
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// The whole configuration of `semlb serve`. See the [module docs](self) for
/// a table of the keys.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Address the dispatchers accept HTTP on (they share it with
    /// `SO_REUSEPORT`). An IP address and a port; port 0 picks a free one.
    #[serde(deserialize_with = "socket_addr")]
    pub listen: SocketAddr,
    /// Number of dispatcher processes. Default: the number of CPU cores
    /// (`std::thread::available_parallelism`), at most [`MAX_DISPATCHERS`].
    pub dispatchers: usize,
    /// Number of response (write-back) processes; each drains the
    /// completion rings of one or more dispatchers. Default 1.
    pub responders: usize,
    /// Name of the shared-memory segment (`/dev/shm/NAME`), as for
    /// `semlb shm --shm-name`. Default `semlb`.
    pub shm_name: String,
    /// Size of the shared-memory segment. Default 256 MiB.
    pub shm_size: ByteSize,
    /// Leave the segment when the supervisor exits, so that the next
    /// supervisor adopts it with its tables (a hot restart, see
    /// [`shm_layout::Segment::claim`]). Default true; false removes it on a
    /// clean stop. `--demo` defaults to false.
    pub keep_segment: bool,
    /// A Hugging Face `tokenizer.json`, or a GGUF model file, to count
    /// prompt tokens with; `None` uses the tokenizer bundled with semlb. It
    /// should be the served model's, so that blocks fall where the
    /// engines' blocks fall.
    pub tokenizer: Option<PathBuf>,
    /// A Hugging Face `tokenizer_config.json` (or a GGUF model file) whose
    /// `chat_template` renders chat messages into the prompt text; `None`
    /// uses a GGUF `tokenizer`'s own, else the canonical rendering
    /// ([`semlb_tokenizer::chat::ChatTemplate::resolve`]).
    pub chat_template: Option<PathBuf>,
    /// Tokens per prefix block. Default 16: vLLM's default KV-cache block
    /// size on GPUs, which is the granularity at which its automatic prefix
    /// caching hashes and reuses a prompt's KV cache. SGLang's radix cache
    /// is token-granular (its `--page-size` resolves to 1 unless an
    /// attention backend needs larger pages), so any block size lines up
    /// with it and 16 costs it nothing. Hashing prompts at the engine's
    /// block size makes the gateway's blocks line up with what the engine
    /// can reuse: `n` matching blocks in the prefix table are `n` blocks the
    /// engine can skip recomputing, with no partial block counted that the
    /// engine would recompute anyway. Set it to the engines' `--block-size`
    /// (vLLM) or `--page-size` (SGLang) when they use another one.
    pub block_size: usize,
    /// Bytes each dispatcher may keep of token ids of text segments it has
    /// tokenized (the text between special tokens, cut at line boundaries
    /// where that changes no token), so that the earlier turns of a
    /// conversation and shared system prompts are not tokenized again.
    /// Default 32 MiB; 0 turns it off. Read when a dispatcher starts.
    pub segment_cache_size: ByteSize,
    /// Learning at dispatch (see [`crate::store`]): a dispatcher records a
    /// prompt's blocks and end key for the server it sends it to, and a
    /// conversation's next turn is credited with the answer the response
    /// processes have not written back yet ([`crate::prefix::continuation`]).
    /// Default true; false leaves all learning to the response processes
    /// (the behaviour before it existed, kept for comparison).
    pub learn_at_dispatch: bool,
    /// Ask engines for the usage of streamed answers whose client did not
    /// (`stream_options.include_usage` added to a streamed request without
    /// `stream_options`), so that they report the prompt tokens they found
    /// cached, and take the usage out of the stream the client gets. Default
    /// true; false relays those streams untouched (they then report nothing).
    pub stream_usage: bool,
    /// Act on what engines report: set aside a server's prefix entries
    /// older than a prefix its engine reported evicted (its horizon), and
    /// forget a server in every prefix entry when its engine
    /// reports no cached prompt for prompts the table listed, twice in a
    /// row, or restarts (a health flap, a counter going back). Default
    /// true; false only counts the reports (for comparison).
    pub learn_from_reports: bool,
    /// The inference servers (`[[backend]]` tables in the file). Required:
    /// there is no default.
    #[serde(rename = "backend")]
    pub backends: Vec<BackendConfig>,
    /// The model pools (`[[model]]` tables, [`models`]); none: one implicit
    /// pool of every backend, for any model name.
    #[serde(rename = "model")]
    pub models: Vec<ModelConfig>,
    /// The routing policy and its parameters (`[policy]`).
    pub policy: PolicyConfig,
    /// The exact-response cache (`[response_cache]`).
    pub response_cache: ResponseCacheConfig,
    /// Agent sessions kept on their engines (`[sessions]`).
    pub sessions: SessionsConfig,
    /// Broken streams resumed on another engine (`[resume]`).
    pub resume: ResumeConfig,
    /// Request limits (`[limits]`).
    pub limits: LimitsConfig,
    /// Where the routing state lives.
    pub store: StoreConfig,
    /// Health checks and load scraping of the backends (`[health]`).
    pub health: HealthConfig,
    /// The admin API (`[admin]`); off unless `admin.listen` is set.
    pub admin: AdminConfig,
    /// Where `/metrics` is served (`[metrics]`).
    pub metrics: MetricsConfig,
    /// The endpoint picker's listener (`[epp]`); off unless `epp.listen` is set.
    pub epp: EppConfig,
    /// Client authentication (`[auth]`); off unless `auth.keys_file` is set.
    pub auth: AuthConfig,
    /// This gateway as a region among peer gateways (`[peering]`,
    /// [`crate::peers`]).
    pub peering: PeeringConfig,
    /// Disaggregated prefill and decode (`[pd]`, [`disaggregation`]).
    pub pd: PdConfig,
    /// Backends found at run time (`[discovery]`): an endpoints file or
    /// Kubernetes ([`crate::discovery`]).
    pub discovery: DiscoveryConfig,
    /// The peer gateways of other regions (`[[peer]]` tables).
    #[serde(rename = "peer")]
    pub peers: Vec<PeerConfig>,
    /// The listener over TLS (`[tls]`; `None`: plain HTTP).
    pub tls: Option<ListenerTls>,
    /// On SIGTERM the dispatchers stop accepting and let requests in flight
    /// finish for up to this many seconds before the supervisor stops them.
    /// Default 30.
    pub drain_timeout_secs: u64,
}

/// The default number of dispatchers: one per CPU core, at most
/// [`MAX_DISPATCHERS`].
pub fn default_dispatchers() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(MAX_DISPATCHERS)
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN,
            dispatchers: default_dispatchers(),
            responders: 1,
            shm_name: DEFAULT_SHM_NAME.to_owned(),
            shm_size: DEFAULT_SHM_SIZE,
            keep_segment: true,
            tokenizer: None,
            chat_template: None,
            block_size: DEFAULT_BLOCK_SIZE,
            segment_cache_size: DEFAULT_SEGMENT_CACHE_SIZE,
            learn_at_dispatch: true,
            stream_usage: true,
            learn_from_reports: true,
            backends: Vec::new(),
            models: Vec::new(),
            policy: PolicyConfig::default(),
            response_cache: ResponseCacheConfig::default(),
            sessions: SessionsConfig::default(),
            resume: ResumeConfig::default(),
            limits: LimitsConfig::default(),
            store: StoreConfig::default(),
            health: HealthConfig::default(),
            admin: AdminConfig::default(),
            metrics: MetricsConfig::default(),
            epp: EppConfig::default(),
            auth: AuthConfig::default(),
            peering: PeeringConfig::default(),
            pd: PdConfig::default(),
            discovery: DiscoveryConfig::default(),
            peers: Vec::new(),
            tls: None,
            drain_timeout_secs: 30,
        }
    }
}

/// Command-line flags of `semlb serve` that override the file; `None` (or
/// an absent flag) keeps the file's value.
#[derive(Debug, Clone, Default)]
pub struct ServeOverrides {
    /// `--listen ADDR`.
    pub listen: Option<SocketAddr>,
    /// `--dispatchers N`.
    pub dispatchers: Option<usize>,
    /// `--responders N`.
    pub responders: Option<usize>,
    /// `--shm-name NAME`.
    pub shm_name: Option<String>,
    /// `--shm-size SIZE`.
    pub shm_size: Option<ByteSize>,
    /// `--backend URL`, repeatable: when given, these replace the file's
    /// `[[backend]]` list (with no names and `metrics_flavor = "auto"`).
    pub backends: Option<Vec<String>>,
    /// `--prefill URL`, repeatable: backends of role `prefill`; with
    /// `--backend` and `--decode`, they replace the file's list.
    pub prefill: Vec<String>,
    /// `--decode URL`, repeatable: backends of role `decode`.
    pub decode: Vec<String>,
    /// `--pd-protocol vllm-nixl|sglang`.
    pub pd_protocol: Option<PdProtocol>,
    /// `--tokenizer PATH`.
    pub tokenizer: Option<PathBuf>,
    /// `--chat-template PATH`.
    pub chat_template: Option<PathBuf>,
    /// `--block-size N`.
    pub block_size: Option<usize>,
    /// `--policy KIND`: the policy kind; its parameters stay the file's.
    pub policy: Option<PolicyKind>,
    /// `--store KIND`.
    pub store: Option<StoreKind>,
    /// `--redis-url URL`.
    pub redis_url: Option<String>,
    /// `--redis-namespace NS`.
    pub redis_namespace: Option<String>,
    /// `--redis-lookup script|naive`.
    pub redis_lookup: Option<RedisLookup>,
    /// `--admin-listen ADDR`.
    pub admin_listen: Option<SocketAddr>,
    /// `--admin-token-file PATH`: replaces the file's `admin.token` and
    /// `admin.token_file`.
    pub admin_token_file: Option<PathBuf>,
    /// `--metrics-listen ADDR`.
    pub metrics_listen: Option<SocketAddr>,
    /// `--discovery KIND`.
    pub discovery: Option<DiscoveryKind>,
    /// `--discovery-file PATH`.
    pub discovery_file: Option<PathBuf>,
    /// `--discovery-selector SELECTOR`.
    pub discovery_selector: Option<String>,
    /// `--discovery-namespace NAMESPACE`.
    pub discovery_namespace: Option<String>,
    /// `--discovery-port PORT`.
    pub discovery_port: Option<u16>,
    /// `--inference-pool NAME`.
    pub inference_pool: Option<String>,
    /// `--epp-listen ADDR`.
    pub epp_listen: Option<SocketAddr>,
}

impl ServeConfig {
    /// Reads and parses the configuration file at `path`; with no path, the
    /// defaults. Does not validate: flags may still complete it (e.g. with
    /// `--backend`), see [`resolve`](Self::resolve).
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses a configuration read from `path` (used in messages, and as
    /// the base of relative `tokenizer` and `chat_template` paths). Does not
    /// validate.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let mut config: Self = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        let base = path.parent().unwrap_or(Path::new(""));
        let model_files = config
            .models
            .iter_mut()
            .flat_map(|m| [&mut m.tokenizer, &mut m.chat_template]);
        for file in [
            &mut config.tokenizer,
            &mut config.chat_template,
            &mut config.admin.token_file,
            &mut config.admin.models_file,
            &mut config.auth.keys_file,
            &mut config.discovery.path,
            &mut config.discovery.kubeconfig,
        ]
        .into_iter()
        .chain(model_files)
        .flatten()
        {
            if file.is_relative() {
                *file = base.join(&*file);
            }
        }
        Ok(config)
    }

    /// Puts the flags over the configuration.
    pub fn apply(&mut self, overrides: ServeOverrides) {
        let ServeOverrides {
            listen,
            dispatchers,
            responders,
            shm_name,
            shm_size,
            backends,
            prefill,
            decode,
            pd_protocol,
            tokenizer,
            chat_template,
            block_size,
            policy,
            store,
            redis_url,
            redis_namespace,
            redis_lookup,
            admin_listen,
            admin_token_file,
            metrics_listen,
            discovery,
            discovery_file,
            discovery_selector,
            discovery_namespace,
            discovery_port,
            inference_pool,
            epp_listen,
        } = overrides;
        let d = &mut self.discovery;
        d.kind = discovery.or(d.kind);
        d.path = discovery_file.or(d.path.take());
        d.selector = discovery_selector.or(d.selector.take());
        d.namespace = discovery_namespace.or(d.namespace.take());
        d.port = discovery_port.or(d.port);
        d.inference_pool = inference_pool.or(d.inference_pool.take());
        if let Some(v) = epp_listen {
            self.epp.listen = Some(v);
        }
        if let Some(v) = metrics_listen {
            self.metrics.listen = Some(v);
        }
        if let Some(v) = admin_listen {
            self.admin.listen = Some(v);
        }
        if let Some(v) = admin_token_file {
            self.admin.token = None;
            self.admin.token_file = Some(v);
        }
        if let Some(v) = store {
            self.store.kind = v;
        }
        if let Some(v) = redis_url {
            self.store.redis.url = v;
        }
        if let Some(v) = redis_namespace {
            self.store.redis.namespace = v;
        }
        if let Some(v) = redis_lookup {
            self.store.redis.lookup = v;
        }
        if let Some(v) = listen {
            self.listen = v;
        }
        if let Some(v) = dispatchers {
            self.dispatchers = v;
        }
        if let Some(v) = responders {
            self.responders = v;
        }
        if let Some(v) = shm_name {
            self.shm_name = v;
        }
        if let Some(v) = shm_size {
            self.shm_size = v;
        }
        if backends.is_some() || !prefill.is_empty() || !decode.is_empty() {
            let with_role = |role| {
                move |url| BackendConfig {
                    role,
                    ..BackendConfig::new(url)
                }
            };
            self.backends = backends
                .unwrap_or_default()
                .into_iter()
                .map(BackendConfig::new)
                .chain(prefill.into_iter().map(with_role(BackendRole::Prefill)))
                .chain(decode.into_iter().map(with_role(BackendRole::Decode)))
                .collect();
        }
        if let Some(v) = pd_protocol {
            self.pd.protocol = v;
        }
        if let Some(v) = tokenizer {
            self.tokenizer = Some(v);
        }
        if let Some(v) = chat_template {
            self.chat_template = Some(v);
        }
        if let Some(v) = block_size {
            self.block_size = v;
        }
        if let Some(kind) = policy {
            self.policy.kind = kind;
        }
    }

    /// The configuration `semlb serve` runs with: the file (if any), the
    /// flags over it, validated.
    /// With `admin.models_file` set, the pools the admin API changed are
    /// merged over the file's ([`ModelChanges`]).
    pub fn resolve(path: Option<&Path>, overrides: ServeOverrides) -> Result<Self, ConfigError> {
        Self::resolve_with(path, overrides, None)
    }

    /// [`resolve`](Self::resolve), with `changes` merged instead of the
    /// contents of `admin.models_file` (the admin API checks a change
    /// before it writes it).
    pub fn resolve_with(
        path: Option<&Path>,
        overrides: ServeOverrides,
        changes: Option<&ModelChanges>,
    ) -> Result<Self, ConfigError> {
        let mut config = Self::load(path)?;
        config.apply(overrides);
        match (changes, &config.admin.models_file) {
            (Some(changes), _) => changes.merge_into(&mut config),
            (None, Some(file)) => ModelChanges::load(file)?.merge_into(&mut config),
            (None, None) => {}
        }
        config.validate()?;
        Ok(config)
    }

    /// [`drain_timeout_secs`](Self::drain_timeout_secs) as a duration.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout_secs)
    }
}

/// `listen`: a socket address, with a message saying what one looks like.
fn socket_addr<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(|_| {
        serde::de::Error::custom(format_args!(
            "invalid address {text:?}: expected an IP address and a port, such as \"0.0.0.0:8080\" or \"[::]:8080\" \
             (host names are not accepted)"
        ))
    })
}

/// `admin.listen`: like [`socket_addr`], present.
fn optional_socket_addr<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<SocketAddr>, D::Error> {
    socket_addr(deserializer).map(Some)
}

/// A string as TOML writes it, for error messages.
fn quoted(s: &str) -> String {
    format!("{s:?}")
}
