//! `semlb tokenize`: what the gateway sees of a request or a text: the
//! prompt text, its segments, token ids and block hashes, and (attached to
//! a running gateway's segment) which servers hold each block.
//!
//! A request body goes through the dispatcher's own code: the same parser
//! and chat rendering ([`semlb::openai::prompt::parse`], so a body the gateway
//! refuses is refused here with the same message), the same tokenizer and
//! block hashing. Block hashes are rooted at the model and the segment's
//! seed, which every gateway segment draws at random: with `--shm-name`
//! the running gateway's seed is used, so the hashes are the ones in its
//! prefix table and each block shows the servers that hold it, and each
//! text segment whether its ids are in the gateway's shared segment store
//! ([`semlb::store::segments`]); without it
//! the seed is `--seed` (0), and the hashes only compare with each other.
//!
//! `--jsonl` reads one JSON value per line on stdin (a string: a text; an
//! object: a request body) and writes one JSON object per line: the
//! interface the outside conformance check
//! (`tokenizer/tests/python/check_tokenize.py`) drives.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cli::{EndpointArg, TokenizeArgs};
use anyhow::{Context, Result, bail};
use semlb::config::ServeConfig;
use semlb::openai::prompt::{self, Endpoint, RoutingInput};
use semlb::pools::{ModelPools, TokenizerLoader};
use semlb::prefix::blocks::BlockHasher;
use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::ChatTemplate;
use serde_json::{Value, json};
use shm_layout::Segment;

/// What the command works with.
#[derive(Clone)]
struct Tools {
    tokenizer: Tokenizer,
    tokenizer_name: String,
    template: Arc<ChatTemplate>,
    block_size: usize,
    segment: Option<Arc<Segment>>,
    seed: u64,
    /// The configuration's model pools, when it has `[[model]]`s and no
    /// flag overrides the tokenizer, template or block size: a request is
    /// then seen with its model's ([`Tools::for_model`]).
    pools: Option<Arc<ModelPools>>,
    /// What chains are rooted at for a model (its pool's name).
    root_model: Option<String>,
}

impl Tools {
    /// The tools of `model`'s pool (these, without pools); the gateway's
    /// 404 for a model it does not serve.
    fn for_model(&self, model: &str) -> Result<Tools, prompt::RequestError> {
        let Some(pools) = &self.pools else {
            return Ok(self.clone());
        };
        let pool = pools
            .find(model)
            .ok_or_else(|| prompt::RequestError::model_not_found(model))?;
        let t = pool.tokenization();
        Ok(Tools {
            tokenizer: t.tokenizer.clone(),
            tokenizer_name: format!("{} (model pool {})", t.name, pool.name().unwrap_or("*")),
            template: t.template.clone(),
            block_size: pool.block_size(),
            root_model: Some(pool.chain_model(model).to_owned()),
            ..self.clone()
        })
    }
}

impl prompt::Templated for Tools {
    fn template(&self) -> &ChatTemplate {
        &self.template
    }
}

/// Runs `semlb tokenize`.
pub fn run(args: &TokenizeArgs, out: &mut impl Write) -> Result<()> {
    let tools = tools(args)?;
    let refused =
        |e: prompt::RequestError| anyhow::anyhow!("the gateway would answer {}: {}", e.status.as_u16(), e.message);
    if args.jsonl {
        let stdin = std::io::stdin();
        for (n, line) in stdin.lock().lines().enumerate() {
            let line = line.context("reading stdin")?;
            let value: Value = serde_json::from_str(&line).with_context(|| format!("line {} is not JSON", n + 1))?;
            let (report, used) = match value {
                Value::String(text) => {
                    let used = tools.for_model(&args.model).map_err(refused)?;
                    (report_text(&used, &args.model, text), used)
                }
                Value::Object(_) => {
                    report_body(&tools, args.endpoint, line.as_bytes()).with_context(|| format!("line {}", n + 1))?
                }
                other => bail!("line {}: expected a JSON string or object, not {other}", n + 1),
            };
            serde_json::to_writer(&mut *out, &report.json(&used, false))?;
            out.write_all(b"\n")?;
        }
        return Ok(());
    }
    let (report, used) = if let Some(body) = &args.body {
        report_body(&tools, args.endpoint, body.as_bytes())?
    } else if let Some(path) = &args.body_file {
        report_body(&tools, args.endpoint, &read_input(path)?)?
    } else if let Some(path) = &args.file {
        let text = String::from_utf8(read_input(path)?).context("the file is not UTF-8")?;
        let used = tools.for_model(&args.model).map_err(refused)?;
        (report_text(&used, &args.model, text), used)
    } else if let Some(text) = &args.text {
        let used = tools.for_model(&args.model).map_err(refused)?;
        (report_text(&used, &args.model, text.clone()), used)
    } else {
        bail!("give a TEXT, --file, --body, --body-file or --jsonl (see semlb tokenize --help)")
    };
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &report.json(&used, true))?;
        out.write_all(b"\n")?;
    } else {
        out.write_all(report.text(&used).as_bytes())?;
    }
    Ok(())
}

fn read_input(path: &Path) -> Result<Vec<u8>> {
    if path == Path::new("-") {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)?;
        Ok(buf)
    } else {
        std::fs::read(path).with_context(|| format!("reading {}", path.display()))
    }
}

fn tools(args: &TokenizeArgs) -> Result<Tools> {
    let config = match &args.config {
        Some(path) => ServeConfig::load(Some(path))?,
        None => ServeConfig::default(),
    };
    let pools = (!config.models.is_empty()
        && args.tokenizer.is_none()
        && args.chat_template.is_none()
        && args.block_size.is_none())
    .then(|| ModelPools::build(&config, &mut TokenizerLoader::new(&config, 0, None), None))
    .transpose()?
    .map(Arc::new);
    let tokenizer_path = args.tokenizer.clone().or(config.tokenizer);
    let tokenizer = match &tokenizer_path {
        Some(path) => Tokenizer::from_file(path)?,
        None => Tokenizer::bundled(),
    }
    .with_segment_cache(0);
    let template = ChatTemplate::resolve(
        args.chat_template
            .as_ref()
            .or(config.chat_template.as_ref())
            .map(PathBuf::as_path),
        tokenizer_path.as_deref(),
    )?;
    let block_size = args.block_size.unwrap_or(config.block_size);
    if block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    let segment = match &args.shm_name {
        Some(name) => Some(Arc::new(
            Segment::open(name).with_context(|| format!("opening the gateway's segment {name}"))?,
        )),
        None => None,
    };
    let seed = segment.as_ref().map_or(args.seed, |s| s.header().seed[0]);
    Ok(Tools {
        tokenizer,
        tokenizer_name: tokenizer_path.map_or("bundled phi-2".to_owned(), |p| p.display().to_string()),
        template: Arc::new(template),
        block_size,
        segment,
        seed,
        pools,
        root_model: None,
    })
}

/// What the gateway sees of one input.
struct Report {
    endpoint: Option<Endpoint>,
    model: String,
    /// The routing text (`None` for a token-id prompt).
    text: Option<String>,
    ids: Vec<u32>,
    segments: Vec<semlb_tokenizer::Segment>,
    blocks: Vec<u64>,
}

fn report_text(tools: &Tools, model: &str, text: String) -> Report {
    let segments = tools.tokenizer.segments(&text);
    let ids: Vec<u32> = segments.iter().flat_map(|s| s.ids.iter().copied()).collect();
    finish(tools, None, model.to_owned(), Some(text), ids, segments)
}

fn report_body(tools: &Tools, endpoint: Option<EndpointArg>, body: &[u8]) -> Result<(Report, Tools)> {
    let endpoint = match endpoint {
        Some(EndpointArg::Chat) => Endpoint::ChatCompletions,
        Some(EndpointArg::Completions) => Endpoint::Completions,
        Some(EndpointArg::Responses) => Endpoint::Responses,
        Some(EndpointArg::Messages) => Endpoint::Messages,
        // A body with `messages` may be chat or Messages: chat unless
        // `--endpoint messages` says otherwise.
        None => match serde_json::from_slice::<Value>(body).ok() {
            Some(v) if v.get("input").is_some() => Endpoint::Responses,
            Some(v) if v.get("messages").is_some() => Endpoint::ChatCompletions,
            _ => Endpoint::Completions,
        },
    };
    let (parsed, tools) = prompt::parse_with(endpoint, body, &prompt::RequestLimits::default(), |model| {
        tools.for_model(model)
    })
    .map_err(|e| anyhow::anyhow!("the gateway would answer {}: {}", e.status.as_u16(), e.message))?;
    let model = parsed.model.to_string();
    let report = match parsed.input {
        RoutingInput::Text(text) => {
            let mut r = report_text(&tools, &model, text.into_owned());
            r.endpoint = Some(endpoint);
            r
        }
        RoutingInput::Tokens(ids) => finish(&tools, Some(endpoint), model, None, ids, Vec::new()),
    };
    Ok((report, tools))
}

fn finish(
    tools: &Tools,
    endpoint: Option<Endpoint>,
    model: String,
    text: Option<String>,
    ids: Vec<u32>,
    segments: Vec<semlb_tokenizer::Segment>,
) -> Report {
    // As the dispatcher hashes a request's tokens.
    let root = tools.root_model.as_deref().unwrap_or(&model);
    let hasher = BlockHasher::new(BlockHasher::root_for(root, tools.seed), tools.block_size);
    let mut blocks = Vec::new();
    hasher.chain(&ids, &mut blocks);
    Report {
        endpoint,
        model,
        text,
        ids,
        segments,
        blocks,
    }
}

impl Report {
    /// The servers holding each block in the attached segment's prefix
    /// table (their addresses), if attached.
    fn holders(&self, tools: &Tools) -> Option<Vec<Vec<String>>> {
        let tables = tools.segment.as_ref()?.tables();
        Some(
            self.blocks
                .iter()
                .map(|b| {
                    let Some(entry) = tables.prefix.lookup(*b) else {
                        return Vec::new();
                    };
                    entry
                        .servers
                        .iter()
                        .filter_map(|tag| tables.servers.get(tag.slot()).filter(|i| i.server.tag() == tag))
                        .map(|i| i.address)
                        .collect()
                })
                .collect(),
        )
    }

    /// Whether each segment's ids are in the attached segment's shared
    /// store (`None` for added tokens, or when not attached).
    fn stored(&self, tools: &Tools) -> Vec<Option<bool>> {
        let text = self.text.as_deref().unwrap_or_default();
        self.segments
            .iter()
            .map(|s| {
                let tables = tools.segment.as_ref()?.tables();
                let key = tools.tokenizer.segment_key(&text[s.range.clone()])?;
                (!s.added_token).then(|| tables.segments.get(shm_layout::ResponseKey(key)).is_some())
            })
            .collect()
    }

    fn json(&self, tools: &Tools, full: bool) -> Value {
        let mut v = json!({
            "ids": self.ids,
            "blocks": self.blocks.iter().map(|b| format!("{b:016x}")).collect::<Vec<_>>(),
        });
        if !full {
            return v;
        }
        let text = self.text.as_deref().unwrap_or_default();
        v["tokenizer"] = json!(tools.tokenizer_name);
        v["engine"] = json!(tools.tokenizer.engine().to_string());
        v["renderer"] = json!(tools.template.renderer_name());
        v["endpoint"] = json!(self.endpoint.map(Endpoint::path));
        v["model"] = json!(self.model);
        v["seed"] = json!(tools.seed);
        v["seed_from_segment"] = json!(tools.segment.is_some());
        v["block_size"] = json!(tools.block_size);
        v["text"] = json!(self.text);
        let stored = self.stored(tools);
        v["segments"] = self
            .segments
            .iter()
            .zip(stored)
            .map(|(s, stored)| {
                let mut seg = json!({
                    "start": s.range.start,
                    "end": s.range.end,
                    "added_token": s.added_token,
                    "text": &text[s.range.clone()],
                    "ids": s.ids,
                });
                if let Some(stored) = stored {
                    seg["in_shared_store"] = json!(stored);
                }
                seg
            })
            .collect();
        if let Some(holders) = self.holders(tools) {
            v["held_by"] = json!(holders);
        }
        v
    }

    fn text(&self, tools: &Tools) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(s, "tokenizer  {} ({})", tools.tokenizer_name, tools.tokenizer.engine());
        if let Some(endpoint) = self.endpoint {
            let _ = writeln!(
                s,
                "request    {} for model {:?}, chat template: {}",
                endpoint.path(),
                self.model,
                tools.template.renderer_name()
            );
        }
        let _ = writeln!(
            s,
            "hashes     seed {:#x} ({}), model {:?}, {} tokens per block",
            tools.seed,
            if tools.segment.is_some() {
                "the running gateway's"
            } else {
                "not a gateway's: give --shm-name to compare with a live table"
            },
            tools.root_model.as_deref().unwrap_or(&self.model),
            tools.block_size
        );
        if let Some(text) = &self.text {
            let _ = writeln!(s, "\nprompt text ({} bytes):\n{text:?}", text.len());
            let _ = writeln!(s, "\nsegments ({}):", self.segments.len());
            for (seg, stored) in self.segments.iter().zip(self.stored(tools)) {
                let kind = if seg.added_token { "added token" } else { "text" };
                let stored = match stored {
                    Some(true) => "  (in the shared store)",
                    _ => "",
                };
                let _ = writeln!(
                    s,
                    "  [{}..{}) {kind} {:?} -> {:?}{stored}",
                    seg.range.start,
                    seg.range.end,
                    &text[seg.range.clone()],
                    seg.ids
                );
            }
        }
        let _ = writeln!(s, "\ntoken ids ({}):\n{:?}", self.ids.len(), self.ids);
        let holders = self.holders(tools);
        let _ = writeln!(s, "\nblocks ({} full):", self.blocks.len());
        for (i, b) in self.blocks.iter().enumerate() {
            let held = match &holders {
                Some(h) if h[i].is_empty() => "  held by no server".to_owned(),
                Some(h) => format!("  held by {}", h[i].join(", ")),
                None => String::new(),
            };
            let _ = writeln!(s, "  {i:>4}  {b:016x}{held}");
        }
        s
    }
}
