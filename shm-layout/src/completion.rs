//! The finished-request record a dispatcher pushes into its completion ring
//! and a response process decodes: which server answered, the block-hash
//! chains that are now warm there, and optionally the response to cache.
//!
//! The chain of prompt + answer comes either as block hashes (`full
//! blocks`), or, so that a dispatcher does not spend its time reading and
//! tokenizing answers, as the *continuation* the response process computes
//! them from: the answer (its bytes in a form the reader names: text, the
//! response's JSON body, or its event stream), the prompt's tokens after
//! its last full block (`tail`), the chain's root and block size (used
//! when the prompt has no full block), and which tokenizer reads the answer
//! (its id in the gateway's model pools, `semlb::pools`; 0: the gateway's
//! global tokenizer). When the answer is the very response
//! the record also carries for the cache, it is not repeated (flag 4).
//!
//! A record may also carry the routing's **prediction** (flag 8): how many
//! of the prompt's blocks the server was expected to hold when it was
//! chosen, how many of those the prefix table listed, when the server
//! last refreshed the deepest listed entry (its stamp, `u32::MAX`: not
//! known), and the prompt tokens the engine reported it found cached, when
//! the dispatcher read the answer itself (`u32::MAX`: not read). The
//! response process compares the prediction with what the engine reported.
//!
//! A record may also carry the request's **timing** (flag 16), which the
//! response process learns the server's admission limit from
//! (`semlb::routing::capacity`): microseconds from sending the request to its
//! answer's end, and to its first byte for a streamed answer (`u32::MAX`:
//! not streamed), and the requests the gateway had in flight to the
//! server once this one was counted.
//!
//! ```text
//! u8 version · u8 flags (1 = response, 2 = continuation, 4 = answer is the response, 8 = prediction, 16 = timing) · u16 server slot · u32 generation
//! u32 prompt tokens · u32 output tokens · u32 #prompt blocks · u32 #full blocks
//! [u128 response key · u32 response len]                                             if flags & 1
//! [u64 chain root · u32 block size · u64 tokenizer · u32 #tail tokens · u8 answer form · u32 answer len]   if flags & 2
//! [u32 block size · u32 predicted blocks · u32 listed blocks · u32 listed stamp · u32 reported cached tokens] if flags & 8
//! [u32 latency µs · u32 first byte µs · u32 in flight at send]                        if flags & 16
//! u64 × #prompt blocks · u64 × #full blocks · u32 × #tail tokens · answer bytes · response bytes
//! ```
//! All integers little-endian. Version 5 (before model pools) had no
//! tokenizer field and is still read (tokenizer 0), so that records pushed
//! by a predecessor during an upgrade are not lost.

use crate::prefix_table::Stamp;
use crate::response_log::ResponseKey;
use crate::server_table::ServerRef;

const VERSION: u8 = 6;
/// The version before the tokenizer field, still decoded.
const VERSION_NO_TOKENIZER: u8 = 5;
const HAS_RESPONSE: u8 = 1;
const HAS_CONTINUATION: u8 = 2;
const ANSWER_IS_RESPONSE: u8 = 4;
const HAS_PREDICTION: u8 = 8;
const HAS_TIMING: u8 = 16;

/// How long a request took and how busy its server was when it was sent
/// (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timing {
    /// Microseconds from sending the request to its answer's end
    /// (saturates at `u32::MAX - 1`: 71 minutes).
    pub latency_us: u32,
    /// Microseconds from sending it to the answer's first byte, for a
    /// streamed answer (a non-streamed one shows its first byte only when
    /// complete).
    pub first_byte_us: Option<u32>,
    /// Requests the gateway had in flight to the server, this one included,
    /// when it was sent.
    pub inflight_at_send: u32,
}

/// What the routing expected the server to hold of the prompt, and what
/// the engine said it held (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Prediction {
    /// Tokens per block.
    pub block_size: u32,
    /// Leading blocks of the prompt the server was expected to hold (the
    /// table's listing, raised by a continued conversation's credit).
    pub predicted_blocks: u32,
    /// Of those, the blocks the prefix table listed for it.
    pub listed_blocks: u32,
    /// When the server itself last refreshed the deepest listed entry, if
    /// the table could tell ([`crate::PrefixMatch::refreshed`]).
    pub refreshed: Option<Stamp>,
    /// Prompt tokens the engine reported it found in its prefix cache,
    /// when the dispatcher read the answer itself.
    pub cached_tokens: Option<u32>,
}

/// What the chain of prompt + answer is computed from, borrowed for
/// encoding (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContinuationRef<'a> {
    /// The chain's root (its hash before the first block).
    pub root: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// The tokenizer that reads the answer (0: the gateway's global one).
    pub tokenizer: u64,
    /// The prompt's tokens after its last full block.
    pub tail: &'a [u32],
    /// How the answer's bytes are to be read (the reader's code).
    pub form: u8,
    /// The answer's bytes; `None`: they are the record's response.
    pub answer: Option<&'a [u8]>,
}

/// A decoded continuation (see [`ContinuationRef`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Continuation {
    /// The chain's root.
    pub root: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// The tokenizer that reads the answer (0: the gateway's global one).
    pub tokenizer: u64,
    /// The prompt's tokens after its last full block.
    pub tail: Vec<u32>,
    /// How the answer's bytes are to be read.
    pub form: u8,
    /// Whether the answer is the record's response (then `answer` is
    /// empty and [`Completion::response`] holds it).
    pub answer_is_response: bool,
    /// The answer's bytes.
    pub answer: Vec<u8>,
}

/// A finished request, borrowed for encoding on the dispatcher side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompletionRecord<'a> {
    /// The server that answered.
    pub server: ServerRef,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Generated length in tokens.
    pub output_tokens: u32,
    /// Chain hashes of the prompt's full blocks.
    pub prompt_blocks: &'a [u64],
    /// Chain hashes of prompt + generated text (what the server now caches),
    /// when the dispatcher computed them.
    pub full_blocks: &'a [u64],
    /// What the response process computes them from, otherwise.
    pub continuation: Option<ContinuationRef<'a>>,
    /// The response to cache, under its exact-request key.
    pub response: Option<(ResponseKey, &'a [u8])>,
    /// What the routing expected of the server.
    pub prediction: Option<Prediction>,
    /// How long the request took.
    pub timing: Option<Timing>,
}

/// A decoded record, owned (the responder reuses one across pops).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Completion {
    /// The server that answered (`None` only in a default value).
    pub server: Option<ServerRef>,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Generated length in tokens.
    pub output_tokens: u32,
    /// Chain hashes of the prompt's full blocks.
    pub prompt_blocks: Vec<u64>,
    /// Chain hashes of prompt + generated text (as sent, or computed by the
    /// response process from [`continuation`](Self::continuation)).
    pub full_blocks: Vec<u64>,
    /// What the full chain is to be computed from, if the dispatcher left
    /// that to the response process.
    pub continuation: Option<Continuation>,
    /// Key of the response to cache, if any.
    pub response_key: Option<ResponseKey>,
    /// The response bytes (empty if none).
    pub response: Vec<u8>,
    /// What the routing expected of the server.
    pub prediction: Option<Prediction>,
    /// How long the request took.
    pub timing: Option<Timing>,
}

/// A record that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than its header or its counts say.
    #[error("completion record truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// Written by another record version.
    #[error("completion record version {0} is not supported")]
    Version(u8),
    /// Bytes left over after the last field.
    #[error("completion record has {0} trailing bytes")]
    Trailing(usize),
    /// The answer is said to be the response, but there is none (or the
    /// record carries answer bytes as well).
    #[error("completion record's answer refers to a response it does not carry, or carries bytes besides")]
    Answer,
}

impl CompletionRecord<'_> {
    /// Encoded length in bytes.
    pub fn encoded_len(&self) -> usize {
        24 + self.response.map_or(0, |(_, r)| 20 + r.len())
            + self.prediction.map_or(0, |_| 20)
            + self.timing.map_or(0, |_| 12)
            + self
                .continuation
                .map_or(0, |c| 29 + 4 * c.tail.len() + c.answer.map_or(0, <[u8]>::len))
            + 8 * (self.prompt_blocks.len() + self.full_blocks.len())
    }

    /// Appends the encoding to `out` (cleared first).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.clear();
        out.reserve(self.encoded_len());
        out.push(VERSION);
        let mut flags = 0;
        if self.response.is_some() {
            flags |= HAS_RESPONSE;
        }
        if let Some(c) = self.continuation {
            flags |= HAS_CONTINUATION;
            if c.answer.is_none() {
                flags |= ANSWER_IS_RESPONSE;
            }
        }
        if self.prediction.is_some() {
            flags |= HAS_PREDICTION;
        }
        if self.timing.is_some() {
            flags |= HAS_TIMING;
        }
        out.push(flags);
        out.extend_from_slice(&self.server.slot.to_le_bytes());
        out.extend_from_slice(&self.server.generation.to_le_bytes());
        for n in [
            self.prompt_tokens,
            self.output_tokens,
            self.prompt_blocks.len() as u32,
            self.full_blocks.len() as u32,
        ] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        if let Some((key, bytes)) = self.response {
            out.extend_from_slice(&key.0.to_le_bytes());
            out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        }
        if let Some(c) = self.continuation {
            out.extend_from_slice(&c.root.to_le_bytes());
            out.extend_from_slice(&c.block_size.to_le_bytes());
            out.extend_from_slice(&c.tokenizer.to_le_bytes());
            out.extend_from_slice(&(c.tail.len() as u32).to_le_bytes());
            out.push(c.form);
            out.extend_from_slice(&(c.answer.map_or(0, <[u8]>::len) as u32).to_le_bytes());
        }
        if let Some(p) = self.prediction {
            for n in [
                p.block_size,
                p.predicted_blocks,
                p.listed_blocks,
                p.refreshed.map_or(u32::MAX, |s| u32::from(s.0)),
                p.cached_tokens.map_or(u32::MAX, |n| n.min(u32::MAX - 1)),
            ] {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
        if let Some(t) = self.timing {
            for n in [
                t.latency_us.min(u32::MAX - 1),
                t.first_byte_us.map_or(u32::MAX, |n| n.min(u32::MAX - 1)),
                t.inflight_at_send,
            ] {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
        for h in self.prompt_blocks.iter().chain(self.full_blocks) {
            out.extend_from_slice(&h.to_le_bytes());
        }
        if let Some(c) = self.continuation {
            for t in c.tail {
                out.extend_from_slice(&t.to_le_bytes());
            }
            out.extend_from_slice(c.answer.unwrap_or_default());
        }
        if let Some((_, bytes)) = self.response {
            out.extend_from_slice(bytes);
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.bytes.len());
        let end = end.ok_or(DecodeError::Truncated {
            need: self.at.saturating_add(n),
            have: self.bytes.len(),
        })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64s(&mut self, n: u32, out: &mut Vec<u64>) -> Result<(), DecodeError> {
        let bytes = self.take(n as usize * 8)?;
        out.clear();
        out.extend(
            bytes
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
        );
        Ok(())
    }
}

impl Completion {
    /// Decodes `bytes` into `self`, reusing its buffers.
    pub fn decode_from(&mut self, bytes: &[u8]) -> Result<(), DecodeError> {
        let mut r = Reader { bytes, at: 0 };
        let [version, flags] = r.array()?;
        if version != VERSION && version != VERSION_NO_TOKENIZER {
            return Err(DecodeError::Version(version));
        }
        let slot = u16::from_le_bytes(r.array()?);
        let generation = r.u32()?;
        self.server = Some(ServerRef { slot, generation });
        self.prompt_tokens = r.u32()?;
        self.output_tokens = r.u32()?;
        let (np, nf) = (r.u32()?, r.u32()?);
        let response = if flags & HAS_RESPONSE != 0 {
            Some((ResponseKey(u128::from_le_bytes(r.array()?)), r.u32()?))
        } else {
            None
        };
        let continuation = if flags & HAS_CONTINUATION != 0 {
            let (root, block_size) = (u64::from_le_bytes(r.array()?), r.u32()?);
            let tokenizer = if version == VERSION {
                u64::from_le_bytes(r.array()?)
            } else {
                0
            };
            Some((root, block_size, tokenizer, r.u32()?, r.array::<1>()?[0], r.u32()?))
        } else {
            None
        };
        self.prediction = if flags & HAS_PREDICTION != 0 {
            Some(Prediction {
                block_size: r.u32()?,
                predicted_blocks: r.u32()?,
                listed_blocks: r.u32()?,
                refreshed: u16::try_from(r.u32()?).ok().map(Stamp),
                cached_tokens: Some(r.u32()?).filter(|n| *n != u32::MAX),
            })
        } else {
            None
        };
        self.timing = if flags & HAS_TIMING != 0 {
            Some(Timing {
                latency_us: r.u32()?.min(u32::MAX - 1),
                first_byte_us: Some(r.u32()?).filter(|n| *n != u32::MAX),
                inflight_at_send: r.u32()?,
            })
        } else {
            None
        };
        // An answer that is the response carries no bytes of its own (a
        // record with both is not one the encoder writes).
        if flags & ANSWER_IS_RESPONSE != 0
            && (response.is_none() || continuation.is_none_or(|(_, _, _, _, _, answer)| answer != 0))
        {
            return Err(DecodeError::Answer);
        }
        r.u64s(np, &mut self.prompt_blocks)?;
        r.u64s(nf, &mut self.full_blocks)?;
        match continuation {
            Some((root, block_size, tokenizer, tail, form, answer)) => {
                let mut c = self.continuation.take().unwrap_or_default();
                c.root = root;
                c.block_size = block_size;
                c.tokenizer = tokenizer;
                c.form = form;
                c.answer_is_response = flags & ANSWER_IS_RESPONSE != 0;
                let bytes = r.take(tail as usize * 4)?;
                c.tail.clear();
                c.tail.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))),
                );
                c.answer.clear();
                c.answer.extend_from_slice(r.take(answer as usize)?);
                self.continuation = Some(c);
            }
            None => self.continuation = None,
        }
        self.response.clear();
        self.response_key = None;
        if let Some((key, len)) = response {
            self.response.extend_from_slice(r.take(len as usize)?);
            self.response_key = Some(key);
        }
        match bytes.len() - r.at {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `completion` fuzz target: a latency of `u32::MAX` (which
    /// the encoder never writes: it saturates one below) decoded as itself,
    /// so the record did not survive re-encoding; likewise a cached-token
    /// count of `u32::MAX` (the "none" mark) encoded as none.
    #[test]
    fn saturated_figures_decode_as_they_encode() {
        let server = ServerRef { slot: 1, generation: 1 };
        let rec = CompletionRecord {
            server,
            prompt_tokens: 1,
            output_tokens: 1,
            prompt_blocks: &[],
            full_blocks: &[],
            continuation: None,
            response: None,
            prediction: Some(Prediction {
                cached_tokens: Some(u32::MAX),
                ..Prediction::default()
            }),
            timing: Some(Timing {
                latency_us: u32::MAX - 1,
                first_byte_us: None,
                inflight_at_send: 0,
            }),
        };
        let mut bytes = Vec::new();
        rec.encode_into(&mut bytes);
        let mut c = Completion::default();
        c.decode_from(&bytes).unwrap();
        assert_eq!(c.prediction.unwrap().cached_tokens, Some(u32::MAX - 1));
        let at = bytes.len() - 12; // the timing block ends the record
        bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        c.decode_from(&bytes).unwrap();
        assert_eq!(c.timing.unwrap().latency_us, u32::MAX - 1);
    }

    #[test]
    fn round_trip_with_and_without_response() {
        let server = ServerRef {
            slot: 7,
            generation: 99,
        };
        let rec = CompletionRecord {
            server,
            prompt_tokens: 300,
            output_tokens: 42,
            prompt_blocks: &[1, 2, 3],
            full_blocks: &[1, 2, 3, 4, 5],
            continuation: None,
            response: Some((ResponseKey(u128::MAX - 5), b"{\"choices\":[]}")),
            prediction: None,
            timing: None,
        };
        let mut buf = Vec::new();
        rec.encode_into(&mut buf);
        assert_eq!(buf.len(), rec.encoded_len());
        let mut c = Completion::default();
        c.decode_from(&buf).unwrap();
        assert_eq!(c.server, Some(server));
        assert_eq!((c.prompt_tokens, c.output_tokens), (300, 42));
        assert_eq!(c.full_blocks, vec![1, 2, 3, 4, 5]);
        assert_eq!(c.response_key, Some(ResponseKey(u128::MAX - 5)));
        assert_eq!(c.response, b"{\"choices\":[]}");

        assert_eq!(c.prediction, None);
        let bare = CompletionRecord { response: None, ..rec };
        bare.encode_into(&mut buf);
        c.decode_from(&buf).unwrap();
        assert_eq!((c.response_key, c.response.len()), (None, 0));
        for (cached_tokens, refreshed) in [
            (Some(48), Some(Stamp(7))),
            (Some(0), Some(Stamp(u16::MAX))),
            (None, None),
        ] {
            let prediction = Prediction {
                block_size: 16,
                predicted_blocks: 9,
                listed_blocks: 4,
                refreshed,
                cached_tokens,
            };
            let predicted = CompletionRecord {
                prediction: Some(prediction),
                ..rec
            };
            predicted.encode_into(&mut buf);
            assert_eq!(buf.len(), predicted.encoded_len());
            c.decode_from(&buf).unwrap();
            assert_eq!(c.prediction, Some(prediction));
            assert_eq!(c.response, b"{\"choices\":[]}");
        }
        for first_byte_us in [Some(1500), None] {
            let timing = Timing {
                latency_us: 250_000,
                first_byte_us,
                inflight_at_send: 3,
            };
            let timed = CompletionRecord {
                timing: Some(timing),
                ..rec
            };
            timed.encode_into(&mut buf);
            assert_eq!(buf.len(), timed.encoded_len());
            c.decode_from(&buf).unwrap();
            assert_eq!(c.timing, Some(timing));
            assert_eq!(c.prediction, None);
            assert_eq!(c.response, b"{\"choices\":[]}");
        }
        assert_eq!(c.continuation, None);

        // With a continuation instead of full blocks, and a response.
        let answer = " héllo wörld".as_bytes();
        let cont = CompletionRecord {
            full_blocks: &[],
            continuation: Some(ContinuationRef {
                root: 77,
                block_size: 16,
                tokenizer: 0xfeed,
                tail: &[5, 6, 7],
                form: 2,
                answer: Some(answer),
            }),
            ..rec
        };
        cont.encode_into(&mut buf);
        assert_eq!(buf.len(), cont.encoded_len());
        c.decode_from(&buf).unwrap();
        assert_eq!(c.full_blocks, Vec::<u64>::new());
        assert_eq!(
            c.continuation,
            Some(Continuation {
                root: 77,
                block_size: 16,
                tokenizer: 0xfeed,
                tail: vec![5, 6, 7],
                form: 2,
                answer_is_response: false,
                answer: answer.to_vec(),
            })
        );
        assert_eq!(c.response, b"{\"choices\":[]}");
        // The answer is the response: not carried twice.
        let shared = CompletionRecord {
            continuation: Some(ContinuationRef {
                answer: None,
                ..cont.continuation.unwrap()
            }),
            ..cont
        };
        shared.encode_into(&mut buf);
        assert_eq!(buf.len(), cont.encoded_len() - answer.len());
        c.decode_from(&buf).unwrap();
        let got = c.continuation.clone().unwrap();
        assert!(got.answer_is_response && got.answer.is_empty());
        assert_eq!(c.response, b"{\"choices\":[]}");
        // ... which it must then carry.
        let orphan = CompletionRecord {
            response: None,
            prediction: None,
            ..shared
        };
        orphan.encode_into(&mut buf);
        assert_eq!(c.decode_from(&buf), Err(DecodeError::Answer));
        // A record without one clears what the buffer held.
        bare.encode_into(&mut buf);
        c.decode_from(&buf).unwrap();
        assert_eq!(c.continuation, None);
    }

    /// A version-5 record (no tokenizer field: what a predecessor pushes
    /// during an upgrade) decodes, with the global tokenizer.
    #[test]
    fn version_5_records_still_decode() {
        let rec = CompletionRecord {
            server: ServerRef { slot: 2, generation: 3 },
            prompt_tokens: 20,
            output_tokens: 0,
            prompt_blocks: &[9],
            full_blocks: &[],
            continuation: Some(ContinuationRef {
                root: 5,
                block_size: 16,
                tokenizer: 0,
                tail: &[1, 2, 3, 4],
                form: 1,
                answer: Some(b"hi"),
            }),
            response: None,
            prediction: None,
            timing: None,
        };
        let mut v6 = Vec::new();
        rec.encode_into(&mut v6);
        // The same record as version 5 wrote it: the tokenizer's 8 bytes
        // (after the header, the counts, the root and the block size) gone.
        let at = 24 + 8 + 4;
        let mut v5 = [&v6[..at], &v6[at + 8..]].concat();
        v5[0] = VERSION_NO_TOKENIZER;
        let (mut a, mut b) = (Completion::default(), Completion::default());
        a.decode_from(&v6).unwrap();
        b.decode_from(&v5).unwrap();
        assert_eq!(a, b);
        assert_eq!(b.continuation.unwrap().tokenizer, 0);
    }

    #[test]
    fn bad_records_are_errors_not_panics() {
        let mut c = Completion::default();
        assert!(matches!(c.decode_from(&[]), Err(DecodeError::Truncated { .. })));
        assert_eq!(c.decode_from(&[9, 0]), Err(DecodeError::Version(9)));
        let rec = CompletionRecord {
            server: ServerRef { slot: 1, generation: 1 },
            prompt_tokens: 1,
            output_tokens: 1,
            prompt_blocks: &[1],
            full_blocks: &[],
            continuation: Some(ContinuationRef {
                root: 1,
                block_size: 16,
                tokenizer: 0,
                tail: &[1, 2],
                form: 0,
                answer: Some("é".as_bytes()),
            }),
            response: None,
            prediction: None,
            timing: None,
        };
        let mut buf = Vec::new();
        rec.encode_into(&mut buf);
        for cut in 0..buf.len() {
            assert!(c.decode_from(&buf[..cut]).is_err());
        }
        buf.push(0);
        assert_eq!(c.decode_from(&buf), Err(DecodeError::Trailing(1)));
        // Huge counts must not allocate or overflow.
        let mut evil = buf[..24].to_vec();
        evil[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(c.decode_from(&evil).is_err());
    }
}
