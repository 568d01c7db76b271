//! [`ServeConfig::validate`]: every value and the relations between them.

use super::sections::check_admin_token;
use super::*;

impl ServeConfig {
    /// Checks every value and the relations between them; the first
    /// problem found is returned, naming the key, the value and the reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        if self.dispatchers == 0 {
            return Err(E::invalid("dispatchers", 0, "must be at least 1"));
        }
        if self.dispatchers > MAX_DISPATCHERS {
            return Err(E::invalid(
                "dispatchers",
                self.dispatchers,
                format!("must be at most {MAX_DISPATCHERS} (the segment has one completion ring per dispatcher)"),
            ));
        }
        self.resume.validate("resume")?;
        if self.responders == 0 {
            return Err(E::invalid("responders", 0, "must be at least 1"));
        }
        if self.responders > self.dispatchers {
            return Err(E::invalid(
                "responders",
                self.responders,
                format!(
                    "must be at most dispatchers = {} (a responder drains at least one dispatcher's ring; more would idle)",
                    self.dispatchers
                ),
            ));
        }
        let processes = self.dispatchers + self.responders + 1;
        if processes > PROCESS_SLOTS as usize {
            return Err(E::invalid(
                "responders",
                self.responders,
                format!(
                    "dispatchers + responders + the supervisor = {processes} processes, more than the segment's {PROCESS_SLOTS} process slots"
                ),
            ));
        }
        if let Err(e) = shm_layout::shm_path(&self.shm_name) {
            return Err(E::invalid("shm_name", quoted(&self.shm_name), e.reason));
        }
        let size = self.shm_size.bytes();
        if !(MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(&size) {
            return Err(E::invalid(
                "shm_size",
                quoted(&self.shm_size.to_string()),
                format!(
                    "must be between {} and {}",
                    ByteSize(MIN_SEGMENT_BYTES),
                    ByteSize(MAX_SEGMENT_BYTES)
                ),
            ));
        }
        for (field, path) in [("tokenizer", &self.tokenizer), ("chat_template", &self.chat_template)] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(E::invalid(
                    field,
                    "\"\"",
                    "must not be empty (leave it out for the default)",
                ));
            }
        }
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(E::invalid(
                "block_size",
                self.block_size,
                format!("must be between 1 and {MAX_BLOCK_SIZE} tokens (the engines' KV block size, usually 16)"),
            ));
        }
        if self.segment_cache_size.bytes() > MAX_SEGMENT_CACHE_SIZE.bytes() {
            return Err(E::invalid(
                "segment_cache_size",
                quoted(&self.segment_cache_size.to_string()),
                format!("must be at most {MAX_SEGMENT_CACHE_SIZE} (per dispatcher)"),
            ));
        }
        self.validate_backends()?;
        models::validate_models(&self.models, &self.backends, self.discovery.is_on())?;
        self.discovery.validate(&self.models)?;
        if let Err(e) = self.policy.validate() {
            // The field is relative to `[policy]`.
            let e = e.within("policy");
            return Err(E::invalid(e.field, e.value, e.reason));
        }
        self.validate_response_cache()?;
        self.validate_pd()?;
        self.validate_limits()?;
        self.validate_store()?;
        self.validate_health()?;
        self.validate_admin()?;
        self.validate_metrics()?;
        peers::validate_peering(&self.peering, &self.peers)?;
        if !(1..=100).contains(&self.auth.tenant_share_percent) {
            return Err(E::invalid(
                "auth.tenant_share_percent",
                self.auth.tenant_share_percent,
                "must be between 1 and 100 (100: no bound)",
            ));
        }
        if self.drain_timeout_secs > MAX_TIMEOUT_SECS {
            return Err(E::invalid(
                "drain_timeout_secs",
                self.drain_timeout_secs,
                format!("must be at most {MAX_TIMEOUT_SECS} (one day)"),
            ));
        }
        Ok(())
    }

    fn validate_store(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let r = &self.store.redis;
        if let Err(e) = redis::Client::open(r.url.as_str()) {
            return Err(E::invalid("store.redis.url", quoted(&r.url), e.to_string()));
        }
        let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-');
        if r.namespace.is_empty() || r.namespace.len() > MAX_BACKEND_NAME_BYTES || !r.namespace.chars().all(name_ok) {
            return Err(E::invalid(
                "store.redis.namespace",
                quoted(&r.namespace),
                format!("must be 1 to {MAX_BACKEND_NAME_BYTES} bytes of A-Z a-z 0-9 . _ : -"),
            ));
        }
        if !(1..=MAX_TTL_SECS).contains(&r.prefix_ttl_secs) {
            return Err(E::invalid(
                "store.redis.prefix_ttl_secs",
                r.prefix_ttl_secs,
                format!("must be between 1 and {MAX_TTL_SECS} (one year)"),
            ));
        }
        if !(1..=60_000).contains(&r.timeout_ms) {
            return Err(E::invalid(
                "store.redis.timeout_ms",
                r.timeout_ms,
                "must be between 1 and 60000",
            ));
        }
        if !(r.timeout_ms..=60_000).contains(&r.connect_timeout_ms) {
            return Err(E::invalid(
                "store.redis.connect_timeout_ms",
                r.connect_timeout_ms,
                "must be between store.redis.timeout_ms and 60000",
            ));
        }
        if !(10..=60_000).contains(&r.retry_ms) {
            return Err(E::invalid(
                "store.redis.retry_ms",
                r.retry_ms,
                "must be between 10 and 60000",
            ));
        }
        if r.write_backlog > 1_000_000 {
            return Err(E::invalid(
                "store.redis.write_backlog",
                r.write_backlog,
                "must be at most 1000000",
            ));
        }
        Ok(())
    }

    fn validate_health(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let h = &self.health;
        let path_ok = h.path.starts_with('/')
            && h.path.len() <= MAX_HEALTH_PATH_BYTES
            && !h.path.contains('#')
            && h.path.parse::<http::uri::PathAndQuery>().is_ok();
        if !path_ok {
            return Err(E::invalid(
                "health.path",
                quoted(&h.path),
                format!(
                    "must be a URL path starting with '/', such as \"/health\" (at most {MAX_HEALTH_PATH_BYTES} bytes, no spaces or fragment)"
                ),
            ));
        }
        if !(10..=MAX_HEALTH_INTERVAL_MS).contains(&h.interval_ms) {
            return Err(E::invalid(
                "health.interval_ms",
                h.interval_ms,
                format!("must be between 10 and {MAX_HEALTH_INTERVAL_MS} (one hour)"),
            ));
        }
        if h.timeout_ms == 0 || h.timeout_ms > h.interval_ms {
            return Err(E::invalid(
                "health.timeout_ms",
                h.timeout_ms,
                format!(
                    "must be between 1 and health.interval_ms = {} (one check in flight per server at a time)",
                    h.interval_ms
                ),
            ));
        }
        for (field, value) in [
            ("health.unhealthy_threshold", h.unhealthy_threshold),
            ("health.healthy_threshold", h.healthy_threshold),
        ] {
            if !(1..=MAX_HEALTH_THRESHOLD).contains(&value) {
                return Err(E::invalid(
                    field,
                    value,
                    format!("must be between 1 and {MAX_HEALTH_THRESHOLD} (consecutive results)"),
                ));
            }
        }
        if !(10..=MAX_HEALTH_INTERVAL_MS).contains(&h.scrape_interval_ms) {
            return Err(E::invalid(
                "health.scrape_interval_ms",
                h.scrape_interval_ms,
                format!("must be between 10 and {MAX_HEALTH_INTERVAL_MS} (one hour)"),
            ));
        }
        if h.stale_after_ms < h.scrape_interval_ms || h.stale_after_ms > MAX_TIMEOUT_SECS * 1000 {
            return Err(E::invalid(
                "health.stale_after_ms",
                h.stale_after_ms,
                format!(
                    "must be between health.scrape_interval_ms = {} (else every figure is stale before the next scrape) and {} (one day)",
                    h.scrape_interval_ms,
                    MAX_TIMEOUT_SECS * 1000
                ),
            ));
        }
        Ok(())
    }

    fn validate_admin(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let admin = &self.admin;
        if let Some(token) = &admin.token {
            // Never echo the token itself.
            check_admin_token(token).map_err(|reason| E::invalid("admin.token", "\"(hidden)\"", reason))?;
        }
        if let (Some(_), Some(path)) = (&admin.token, &admin.token_file) {
            return Err(E::invalid(
                "admin.token_file",
                quoted(&path.display().to_string()),
                "set admin.token or admin.token_file, not both",
            ));
        }
        if admin.token_file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(E::invalid("admin.token_file", "\"\"", "must not be empty"));
        }
        if admin.models_file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(E::invalid("admin.models_file", "\"\"", "must not be empty"));
        }
        let Some(listen) = admin.listen else {
            return Ok(());
        };
        if admin.token.is_none() && admin.token_file.is_none() {
            return Err(E::invalid(
                "admin.listen",
                quoted(&listen.to_string()),
                "the admin API needs a bearer token: set admin.token or admin.token_file (or --admin-token-file)",
            ));
        }
        self.check_own_address("admin.listen", listen, "the admin API")
    }

    /// `[metrics]`.
    fn validate_metrics(&self) -> Result<(), ConfigError> {
        let Some(listen) = self.metrics.listen else {
            return Ok(());
        };
        self.check_own_address("metrics.listen", listen, "the metrics listener")?;
        match self.admin.listen {
            Some(admin) if collide(listen, admin) => Err(ConfigError::invalid(
                "metrics.listen",
                quoted(&listen.to_string()),
                format!("must differ from admin.listen = {}", quoted(&admin.to_string())),
            )),
            _ => Ok(()),
        }
    }

    /// `key = addr` must not be the gateway's `listen`.
    fn check_own_address(&self, key: &'static str, addr: SocketAddr, what: &str) -> Result<(), ConfigError> {
        if collide(addr, self.listen) {
            return Err(ConfigError::invalid(
                key,
                quoted(&addr.to_string()),
                format!(
                    "must differ from listen = {} ({what} has its own address)",
                    quoted(&self.listen.to_string())
                ),
            ));
        }
        Ok(())
    }

    fn validate_backends(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        if self.backends.is_empty() && !self.discovery.is_on() {
            return Err(E::invalid(
                "backend",
                "[]",
                "at least one backend is needed ([[backend]] url = \"http://host:port\", or --backend URL), or [discovery] to find them",
            ));
        }
        if self.backends.len() > MAX_BACKENDS {
            return Err(E::invalid(
                "backend",
                format!("[{} tables]", self.backends.len()),
                format!("at most {MAX_BACKENDS} backends fit the segment's server table"),
            ));
        }
        let mut urls: HashMap<BackendUrl, usize> = HashMap::new();
        let mut names: HashMap<String, usize> = HashMap::new();
        for (i, backend) in self.backends.iter().enumerate() {
            let url = backend
                .parsed_url()
                .map_err(|reason| E::invalid(format!("backend[{i}].url"), quoted(&backend.url), reason))?;
            if let Some(first) = urls.insert(url, i) {
                return Err(E::invalid(
                    format!("backend[{i}].url"),
                    quoted(&backend.url),
                    format!("the same server as backend[{first}].url"),
                ));
            }
            if let (Some(name), Err(reason)) = (&backend.name, backend.check_name()) {
                return Err(E::invalid(format!("backend[{i}].name"), quoted(name), reason));
            }
            if let Err(reason) = backend.check_weight() {
                return Err(E::invalid(
                    format!("backend[{i}].weight"),
                    backend.weight.to_string(),
                    reason,
                ));
            }
            for (field, endpoint) in [
                ("kv_events", &backend.kv_events),
                ("kv_events_replay", &backend.kv_events_replay),
            ] {
                if let Some(endpoint) = endpoint
                    && let Err(reason) = BackendConfig::check_events_endpoint(endpoint)
                {
                    return Err(E::invalid(format!("backend[{i}].{field}"), quoted(endpoint), reason));
                }
            }
            if backend.kv_events.is_none()
                && let Some(replay) = &backend.kv_events_replay
            {
                return Err(E::invalid(
                    format!("backend[{i}].kv_events_replay"),
                    quoted(replay),
                    "replays the events of a kv_events endpoint: set kv_events too",
                ));
            }
            if backend.bootstrap_port == Some(0) {
                return Err(E::invalid(
                    format!("backend[{i}].bootstrap_port"),
                    0,
                    "must be 1 to 65535 (the port of the engine's bootstrap server)",
                ));
            }
            let name = backend.display_name();
            if let Some(first) = names.insert(name.clone(), i) {
                return Err(E::invalid(
                    format!("backend[{i}].name"),
                    quoted(&name),
                    format!("backend[{first}] has that name already; names must be unique"),
                ));
            }
        }
        Ok(())
    }

    fn validate_pd(&self) -> Result<(), ConfigError> {
        use super::disaggregation::MAX_PREFILL_TIMEOUT_SECS;
        let secs = self.pd.prefill_timeout_secs;
        if !(1..=MAX_PREFILL_TIMEOUT_SECS).contains(&secs) {
            return Err(ConfigError::invalid(
                "pd.prefill_timeout_secs",
                secs,
                format!("must be 1 to {MAX_PREFILL_TIMEOUT_SECS}"),
            ));
        }
        Ok(())
    }

    fn validate_response_cache(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let cache = &self.response_cache;
        if cache.ttl_secs == 0 || cache.ttl_secs > MAX_TTL_SECS {
            return Err(E::invalid(
                "response_cache.ttl_secs",
                cache.ttl_secs,
                format!("must be between 1 and {MAX_TTL_SECS} (one year); to turn the cache off, set enabled = false"),
            ));
        }
        let f = cache.max_value_fraction;
        if !(f > 0.0 && f <= 0.5) {
            return Err(E::invalid(
                "response_cache.max_value_fraction",
                f,
                "must be greater than 0 and at most 0.5 (a share of the response log)",
            ));
        }
        Ok(())
    }

    fn validate_limits(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let limits = &self.limits;
        if limits.max_body_bytes.bytes() == 0 {
            return Err(E::invalid(
                "limits.max_body_bytes",
                quoted(&limits.max_body_bytes.to_string()),
                "must be greater than 0 (every request would be refused)",
            ));
        }
        if limits.request_timeout_secs == 0 || limits.request_timeout_secs > MAX_TIMEOUT_SECS {
            return Err(E::invalid(
                "limits.request_timeout_secs",
                limits.request_timeout_secs,
                format!("must be between 1 and {MAX_TIMEOUT_SECS} (one day)"),
            ));
        }
        if limits.connect_timeout_ms == 0 {
            return Err(E::invalid("limits.connect_timeout_ms", 0, "must be at least 1"));
        }
        if limits.connect_timeout_ms > limits.request_timeout_secs * 1000 {
            return Err(E::invalid(
                "limits.connect_timeout_ms",
                limits.connect_timeout_ms,
                format!(
                    "must be at most limits.request_timeout_secs = {} in milliseconds ({})",
                    limits.request_timeout_secs,
                    limits.request_timeout_secs * 1000
                ),
            ));
        }
        if limits.retries > MAX_RETRIES {
            return Err(E::invalid(
                "limits.retries",
                limits.retries,
                format!("must be at most {MAX_RETRIES} (more retries only multiply the load on failing servers)"),
            ));
        }
        if limits.client_timeout_secs == 0 || limits.client_timeout_secs > MAX_CLIENT_TIMEOUT_SECS {
            return Err(E::invalid(
                "limits.client_timeout_secs",
                limits.client_timeout_secs,
                format!("must be between 1 and {MAX_CLIENT_TIMEOUT_SECS} (one hour)"),
            ));
        }
        if limits.max_messages == 0 {
            return Err(E::invalid(
                "limits.max_messages",
                0,
                "must be at least 1 (every chat would be refused)",
            ));
        }
        if limits.max_prompt_bytes.bytes() == 0 {
            return Err(E::invalid(
                "limits.max_prompt_bytes",
                quoted(&limits.max_prompt_bytes.to_string()),
                "must be greater than 0 (every request would be refused)",
            ));
        }
        if limits.max_connections == 0 || limits.max_connections > MAX_CONNECTIONS {
            return Err(E::invalid(
                "limits.max_connections",
                limits.max_connections,
                format!("must be between 1 and {MAX_CONNECTIONS}"),
            ));
        }
        if limits.max_connections_per_ip > limits.max_connections {
            return Err(E::invalid(
                "limits.max_connections_per_ip",
                limits.max_connections_per_ip,
                format!("must be at most limits.max_connections ({})", limits.max_connections),
            ));
        }
        if limits.max_inflight_body_bytes.bytes() < limits.max_body_bytes.bytes() {
            return Err(E::invalid(
                "limits.max_inflight_body_bytes",
                limits.max_inflight_body_bytes,
                "must be at least limits.max_body_bytes (else the largest body allowed could never be read)",
            ));
        }
        Ok(())
    }
}

/// Whether binding both addresses would collide (port 0 picks a free port
/// for each, so it never does).
fn collide(a: SocketAddr, b: SocketAddr) -> bool {
    let same_ip = a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified();
    a.port() != 0 && a.port() == b.port() && same_ip
}
