//! The relay's side of a resumable stream ([`super::super::resume`]):
//! a break found (cut, error event, stall, a drained engine retired), the
//! next attempt started, its head taken as the same answer, or the
//! client's stream ended with an error event when it cannot go on.

use super::*;

impl Relay {
    /// Resumes the stream as `resume` says when its engine breaks (a chat
    /// stream: [`super::resume`]).
    pub fn resumable(mut self, resume: Resume) -> Self {
        self.resume = Some(Box::new(resume));
        self
    }

    /// The stream broke (`why`): the engine's failure is counted, its
    /// in-flight count ended and its body dropped; then the next attempt
    /// is under way, or `Err` holds the events that end the client's
    /// stream.
    pub(super) fn break_stream(&mut self, why: Break) -> Result<(), Bytes> {
        if self.resume.is_none() {
            return Err(Bytes::new());
        }
        self.stall = None;
        self.inner = fed().1;
        let server = if why == Break::Drain {
            // A drain is no failure of the engine: its count just ends.
            self.guard.take().map(|g| g.server())
        } else {
            self.server_failed(|address| Failure::Body { address })
        };
        let Some(server) = server else {
            return Err(Bytes::new());
        };
        let deadline = self.deadline.deadline();
        let resume = self.resume.as_mut().ok_or_else(Bytes::new)?;
        let attempt = resume.broke(server, why, deadline)?;
        self.resuming = Some(attempt);
        Ok(())
    }

    /// Whether the answering engine was retired (drained past its
    /// deadline, or re-registered) while this stream, which may move,
    /// still runs on it. One atomic load per frame; a stream that may not
    /// move is asked once and then left to run where it is.
    pub(super) fn retired(&mut self) -> bool {
        let (Some(guard), Some(resume)) = (self.guard.as_ref(), self.resume.as_ref()) else {
            return false;
        };
        if self.stays || self.broken.is_some() {
            return false;
        }
        let server = guard.server();
        let servers = &self.dispatcher.segment().tables().servers;
        if servers.current(server.slot).is_some_and(|(now, _)| now == server) {
            return false;
        }
        self.stays = !resume.movable();
        !self.stays
    }

    /// A resumed attempt's head came: its body is relayed from now on, as
    /// the same answer.
    pub(super) fn resumed_on(&mut self, head: ResumedHead) {
        if let Some(resume) = &self.resume {
            resume.resumed();
        }
        self.inner = UpstreamBody::Engine(head.body);
        self.address = head.address;
        self.guard = Some(head.guard);
        if let Some(learn) = self.learn.as_mut() {
            learn.server = head.server;
        }
    }

    /// Whether the stream has sent nothing for `resume.stall_ms` (its timer
    /// fired and no data came since it was set; else it is set again from
    /// the last data, and polled so that it wakes this task).
    pub(super) fn stalled(&mut self, cx: &mut Context<'_>) -> bool {
        let (Some(sleep), Some(stall)) = (self.stall.as_mut(), self.resume.as_ref().and_then(|r| r.stall())) else {
            return false;
        };
        loop {
            if sleep.as_mut().poll(cx).is_pending() {
                return false;
            }
            let due = self.last_data + stall;
            if due <= tokio::time::Instant::now() {
                return true;
            }
            sleep.as_mut().reset(due);
        }
    }

    /// Ends a broken stream that is not resumed: charged what it relayed,
    /// nothing learned; `end` (its error event and `data: [DONE]`) is the
    /// client's last frame.
    pub(super) fn end_broken(&mut self, end: Bytes) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // What the usage strip held (an event longer than a whole event
        // may be: `resume::events`) goes first.
        let held = self.strip.as_mut().map(UsageStrip::finish).unwrap_or_default();
        let end = if held.is_empty() {
            end
        } else {
            [held, end].concat().into()
        };
        self.guard = None;
        self.abandon();
        Poll::Ready((!end.is_empty()).then(|| Ok(Frame::data(end))))
    }
}
