//! Rate-limit buckets in Redis ([`crate::tenancy::rate_limit`]): every bucket of a
//! request charged in one round trip by [`LIMIT_SCRIPT`], which reads
//! Redis's clock, so every host sharing the namespace charges the same
//! buckets by the same time. A bucket is the key `{ns}:rl:<key, 16 hex
//! digits>`, a STRING holding its `tat` (Redis time, µs), expiring when the
//! bucket is full again. A dispatcher takes a request's buckets waiting
//! for the verdict, and charges or refunds them without waiting; while
//! Redis is down, this host's limit table stands in.

use std::sync::atomic::Ordering::Relaxed;

use redis::Value;
use shm_layout::BucketState;

use super::RedisRouting;
use super::client::{ReplyError, StoreError};
pub(crate) use super::scripts::LIMIT_SCRIPT;
use crate::tenancy::rate_limit::{Charge, Settlement, Verdict};

/// Nanoseconds per microsecond (the script keeps µs: a Lua number holds
/// Unix µs exactly, not ns).
const NS_PER_US: u64 = 1000;

/// Whether the script takes (all or none) or charges (room or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// All or none, within the limits.
    Take,
    /// Room or not (output tokens).
    Charge,
    /// Given back (a reservation not used).
    Refund,
}

/// The `EVALSHA` of [`LIMIT_SCRIPT`] (hash `sha`) for `charges` under
/// namespace `ns`.
pub(crate) fn limit_pipeline(ns: &str, sha: &str, mode: Mode, charges: &[Charge]) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    pipe.add_command(limit_command(ns, sha, mode, charges));
    pipe
}

/// The command of [`limit_pipeline`].
fn limit_command(ns: &str, sha: &str, mode: Mode, charges: &[Charge]) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(charges.len());
    for c in charges {
        cmd.arg(format!("{ns}:rl:{:016x}", c.key));
    }
    cmd.arg(match mode {
        Mode::Take => "take",
        Mode::Charge => "charge",
        Mode::Refund => "refund",
    });
    for c in charges {
        cmd.arg(c.quota.limit.max(1))
            .arg((c.quota.period_ns / NS_PER_US).max(1))
            .arg(c.n);
    }
    cmd
}

/// The verdict in the script's reply to a take of `charges`.
pub(crate) fn parse_verdict(replies: &[Value], charges: &[Charge]) -> Result<Verdict, ReplyError> {
    let Some(Value::Array(reply)) = replies.first() else {
        return Err(ReplyError::LimitReply(replies.to_vec()));
    };
    let int = |i: usize| match reply.get(i) {
        Some(Value::Int(n)) => Ok(*n),
        other => Err(ReplyError::LimitValue(other.cloned(), i)),
    };
    let index = |i: usize| {
        let k = usize::try_from(int(i)?).map_err(|_| ReplyError::NegativeIndex)?;
        (1..=charges.len())
            .contains(&k)
            .then_some(k - 1)
            .ok_or(ReplyError::KeyIndex {
                index: k,
                keys: charges.len(),
            })
    };
    let ns = |i: usize| int(i).map(|us| u64::try_from(us).unwrap_or(0) * NS_PER_US);
    match int(0)? {
        0 if reply.len() == charges.len() + 1 => Ok(Verdict::Allowed(
            charges
                .iter()
                .enumerate()
                .map(|(i, c)| ns(i + 1).map(|ahead| c.quota.state(ahead)))
                .collect::<Result<Vec<BucketState>, ReplyError>>()?,
        )),
        -1 => Ok(Verdict::TooLarge { index: index(1)? }),
        -2 => {
            let i = index(1)?;
            Ok(Verdict::Limited {
                index: i,
                state: charges[i].quota.state(ns(3)?),
                retry_after_ns: ns(2)?,
            })
        }
        other => Err(ReplyError::LimitStatus {
            status: other,
            values: reply.len(),
        }),
    }
}

impl RedisRouting {
    /// What [`RoutingStore::take_limits`](crate::store::RoutingStore::take_limits)
    /// answers: the script's verdict, or this host's table's while Redis
    /// cannot be asked.
    pub(super) async fn take(&self, charges: &[Charge]) -> Verdict {
        const OP: &str = "rate limit";
        let pipe = limit_pipeline(&self.names.namespace, &self.names.limit, Mode::Take, charges);
        let asked = async {
            let replies = self.query(OP, &pipe).await?;
            parse_verdict(&replies, charges).map_err(|detail| StoreError::Protocol { op: OP, detail })
        };
        // Redis unreachable or slow: this host's table limits alone.
        match self.guarded(OP, asked).await {
            Some(verdict) => verdict,
            None => self.local.take_limits(charges),
        }
    }

    /// Settles an answer's reservation, done when Redis has it: the
    /// charges beyond it and the refund of what it did not use in one
    /// round trip, so that the client's next request, sent the instant the
    /// answer ends (on any dispatcher of any host), finds them. While Redis
    /// cannot be asked (or does not answer in time), this host's table
    /// takes them, as it takes the requests then.
    pub(super) async fn settle(&self, settlement: &Settlement) {
        const OP: &str = "rate limit settlement";
        if settlement.charge.is_empty() && settlement.refund.is_empty() {
            return;
        }
        let (ns, sha) = (&self.names.namespace, &self.names.limit);
        let mut pipe = redis::pipe();
        for (mode, charges) in [(Mode::Charge, &settlement.charge), (Mode::Refund, &settlement.refund)] {
            if !charges.is_empty() {
                pipe.add_command(limit_command(ns, sha, mode, charges));
            }
        }
        if self.guarded(OP, self.query(OP, &pipe)).await.is_none() {
            self.local.charge_limits(&settlement.charge);
            self.local.refund_limits(&settlement.refund);
        }
    }

    /// Charges or gives back `charges` without waiting: in Redis, or in
    /// this host's table while Redis is down.
    pub(super) fn settle_detached(&self, mode: Mode, charges: &[Charge]) {
        if charges.is_empty() {
            return;
        }
        if self.health.down.load(Relaxed) || self.conn.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            match mode {
                Mode::Refund => self.local.refund_limits(charges),
                _ => self.local.charge_limits(charges),
            }
            return;
        }
        self.send_detached(limit_pipeline(&self.names.namespace, &self.names.limit, mode, charges));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shm_layout::Quota;

    const SEC: u64 = 1_000_000_000;

    fn charges() -> Vec<Charge> {
        vec![
            Charge {
                key: 0xab,
                quota: Quota::per_minute(60),
                n: 1,
            },
            Charge {
                key: 0xcd,
                quota: Quota::per_minute(1000),
                n: 300,
            },
        ]
    }

    #[test]
    fn the_pipeline_names_the_buckets_and_their_quotas_in_microseconds() {
        let pipe = limit_pipeline("ns", "sha", Mode::Take, &charges());
        let packed = String::from_utf8_lossy(&pipe.get_packed_pipeline()).into_owned();
        let args: Vec<&str> = packed.split("\r\n").filter(|l| !l.starts_with(['*', '$'])).collect();
        assert_eq!(
            args,
            [
                "EVALSHA",
                "sha",
                "2",
                "ns:rl:00000000000000ab",
                "ns:rl:00000000000000cd",
                "take",
                "60",
                "60000000",
                "1",
                "1000",
                "60000000",
                "300",
                ""
            ]
        );
        let refund = limit_pipeline("ns", "sha", Mode::Refund, &charges());
        assert!(String::from_utf8_lossy(&refund.get_packed_pipeline()).contains("\r\nrefund\r\n"));
        // The script's debt horizon is the segment table's.
        assert!(LIMIT_SCRIPT.contains(&format!(
            "local horizon = {} * period",
            shm_layout::limit_table::DEBT_PERIODS + 1
        )));
    }

    #[test]
    fn replies_become_verdicts_and_bad_replies_errors() {
        let c = charges();
        let reply = |v: &[i64]| vec![Value::Array(v.iter().map(|n| Value::Int(*n)).collect())];
        let Verdict::Allowed(states) = parse_verdict(&reply(&[0, 1_000_000, 18_000_000]), &c).unwrap() else {
            panic!()
        };
        assert_eq!(
            states,
            [
                BucketState {
                    remaining: 59,
                    reset_ns: SEC
                },
                BucketState {
                    remaining: 700,
                    reset_ns: 18 * SEC
                }
            ]
        );
        assert_eq!(
            parse_verdict(&reply(&[-1, 2]), &c).unwrap(),
            Verdict::TooLarge { index: 1 }
        );
        assert_eq!(
            parse_verdict(&reply(&[-2, 1, 500_000, 60_000_000]), &c).unwrap(),
            Verdict::Limited {
                index: 0,
                state: BucketState {
                    remaining: 0,
                    reset_ns: 60 * SEC
                },
                retry_after_ns: SEC / 2
            }
        );
        for bad in [reply(&[0, 1]), reply(&[-2, 3, 1, 1]), reply(&[7]), vec![Value::Nil]] {
            assert!(parse_verdict(&bad, &c).is_err(), "{bad:?}");
        }
    }
}
