//! The pull budget against a model of the server, and the classification of
//! what arrives on a reader's inbox.

use std::collections::VecDeque;

use async_nats::header::HeaderMap;
use proptest::prelude::*;

use super::*;

fn status(code: u16, description: &str, pending: Option<(&str, &str)>) -> async_nats::Message {
    let headers = pending.map(|(messages, bytes)| {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Pending-Messages", messages);
        headers.insert("Nats-Pending-Bytes", bytes);
        headers
    });
    async_nats::Message {
        subject: Subject::from("_INBOX.x"),
        reply: None,
        payload: Bytes::new(),
        headers,
        status: Some(StatusCode::from_u16(code).expect("a status code")),
        description: Some(description.to_owned()),
        length: 0,
    }
}

#[test]
fn a_request_is_due_at_first_and_again_when_half_is_spent() {
    let mut budget = PullBudget::new(1000);
    assert!(budget.wants_request());
    budget.book();
    assert!(!budget.wants_request());
    for _ in 0..4 {
        budget.delivered(100);
        assert!(!budget.wants_request());
    }
    budget.delivered(100);
    assert!(budget.wants_request(), "half of the bytes spent");
    assert_eq!(
        budget.request_messages(),
        1000,
        "messages never end a request first"
    );
}

#[test]
fn a_request_answered_in_full_leaves_nothing_booked() {
    // One large message, then the next does not fit: the server ends the
    // request, saying what it had left. Booked first, nothing stays open.
    let mut budget = PullBudget::new(1 << 20);
    budget.book();
    budget.delivered(640 << 10);
    budget.ended(Some((1 << 20) - (640 << 10)));
    assert_eq!(budget.open(), 0);
    assert!(budget.wants_request());
}

#[test]
fn a_request_whose_bytes_run_out_exactly_leaves_nothing_booked() {
    // The server ends such a request without a word, whatever message count it
    // had left; only bytes are booked, so nothing is left over.
    let mut budget = PullBudget::new(2015);
    budget.book();
    budget.delivered(2015);
    assert_eq!(budget.open(), 0);
    assert!(budget.wants_request());
}

#[test]
fn an_end_that_does_not_say_what_was_left_forgets_every_request() {
    let mut budget = PullBudget::new(1000);
    budget.book();
    budget.book();
    budget.ended(None);
    assert_eq!(budget.open(), 0);
}

#[test]
fn statuses_are_classified() {
    assert_eq!(
        classify(&status(100, "Idle Heartbeat", None), 1000),
        Delivery::Heartbeat
    );
    assert_eq!(
        classify(&status(408, "Request Timeout", Some(("7", "700"))), 1000),
        Delivery::Ended(Some(700))
    );
    assert_eq!(
        classify(
            &status(409, "Message Size Exceeds MaxBytes", Some(("99", "12"))),
            1000
        ),
        Delivery::Ended(Some(12))
    );
    assert_eq!(
        classify(&status(409, "Batch Completed", Some(("0", "300"))), 1000),
        Delivery::Ended(Some(300))
    );
    assert_eq!(
        classify(&status(409, "Leadership Change", None), 1000),
        Delivery::Ended(None)
    );
    assert_eq!(
        classify(&status(409, "Server Shutdown", Some(("1", "x"))), 1000),
        Delivery::Ended(None),
        "unreadable headers end every request"
    );
    for fatal in [
        "Consumer Deleted",
        "Consumer is push based",
        "Exceeded MaxWaiting",
    ] {
        assert!(
            matches!(
                classify(&status(409, fatal, None), 1000),
                Delivery::Fatal(_)
            ),
            "{fatal}"
        );
    }
    assert!(
        matches!(
            classify(
                &status(409, "Message Size Exceeds MaxBytes", Some(("100", "1000"))),
                1000
            ),
            Delivery::Fatal(_)
        ),
        "a message no request can hold"
    );
    assert!(matches!(
        classify(&status(503, "", None), 1000),
        Delivery::Fatal(_)
    ));
    assert!(matches!(
        classify(&status(500, "?", None), 1000),
        Delivery::Fatal(_)
    ));
}

/// One open pull request at the model server.
#[derive(Debug, Clone, Copy)]
struct OpenRequest {
    messages: usize,
    bytes: usize,
}

/// What the reader sees on its inbox.
#[derive(Debug, Clone, Copy)]
enum Seen {
    Message(usize),
    Ended(Option<usize>),
}

/// A pull consumer's open requests as nats-server keeps them: served in
/// turn, each charged a message's whole size; a request whose bytes or
/// messages run out ends after that message without a word (servers before
/// 2.11 say nothing even when bytes are left), and one the next message does
/// not fit ends with a `409` carrying what was left.
#[derive(Debug, Default)]
struct ServerModel {
    waiting: VecDeque<OpenRequest>,
}

impl ServerModel {
    fn held_bytes(&self) -> usize {
        self.waiting.iter().map(|request| request.bytes).sum()
    }

    /// Offers one stored message of `size` bytes to the open requests.
    fn offer(&mut self, size: usize) -> Vec<Seen> {
        let mut seen = Vec::new();
        while let Some(mut request) = self.waiting.pop_front() {
            if size > request.bytes {
                seen.push(Seen::Ended(Some(request.bytes)));
                continue;
            }
            request.bytes -= size;
            if request.bytes == 0 {
                request.messages = 1;
            }
            request.messages -= 1;
            seen.push(Seen::Message(size));
            if request.messages > 0 {
                self.waiting.push_back(request);
            }
            break;
        }
        seen
    }
}

/// One step of a server answering a reader's requests.
#[derive(Debug, Clone)]
enum Step {
    /// A stored message of this many bytes (at most a whole request).
    Message(usize),
    /// The request at this index (modulo those open) expires.
    Expire(usize),
    /// A leadership change ends every request without saying what was left.
    EndAll,
    /// A restarted server forgets every request without a word; the reader
    /// hears nothing for two heartbeats and forgets its books.
    LoseAll,
}

/// Plays `steps` between a reader booking `request_bytes` per request and the
/// model server; an error says where the books first parted from the server.
fn play(request_bytes: usize, steps: &[Step]) -> Result<(), String> {
    let mut server = ServerModel::default();
    let mut budget = PullBudget::new(request_bytes);
    for (index, step) in steps.iter().enumerate() {
        if budget.wants_request() {
            budget.book();
            server.waiting.push_back(OpenRequest {
                messages: budget.request_messages(),
                bytes: request_bytes,
            });
        }
        let seen = match *step {
            Step::Message(size) => server.offer(size.min(request_bytes)),
            Step::Expire(at) if !server.waiting.is_empty() => {
                let at = at % server.waiting.len();
                let request = server.waiting.remove(at).expect("in range");
                vec![Seen::Ended(Some(request.bytes))]
            }
            Step::Expire(_) => Vec::new(),
            Step::EndAll => {
                server.waiting.clear();
                vec![Seen::Ended(None)]
            }
            Step::LoseAll => {
                server.waiting.clear();
                budget.forget();
                Vec::new()
            }
        };
        for seen in seen {
            match seen {
                Seen::Message(length) => budget.delivered(length),
                Seen::Ended(left) => budget.ended(left),
            }
        }
        if budget.open() != server.held_bytes() {
            return Err(format!(
                "after step {index}: books {} B, server {:?}",
                budget.open(),
                server.waiting
            ));
        }
        if server.waiting.is_empty() && !budget.wants_request() {
            return Err(format!(
                "after step {index}: no request at the server, none due"
            ));
        }
    }
    Ok(())
}

proptest! {
    /// Whatever the server answers, the books hold exactly the bytes the
    /// server's open requests still allow, so a reader never waits on a
    /// request the server no longer holds.
    #[test]
    fn the_books_hold_exactly_what_the_server_holds(
        request_bytes in 1usize..5000,
        steps in proptest::collection::vec(
            prop_oneof![
                6 => (1usize..5000).prop_map(Step::Message),
                1 => any::<usize>().prop_map(Step::Expire),
                1 => Just(Step::EndAll),
                1 => Just(Step::LoseAll),
            ],
            0..300,
        ),
    ) {
        play(request_bytes, &steps).map_err(TestCaseError::fail)?;
    }
}

/// The counterexample books of messages as well as bytes failed on: a request
/// whose bytes run out exactly, then one whose messages do.
#[test]
fn bytes_that_run_out_exactly_then_messages_that_do_keep_the_books_exact() {
    play(2015, &[2015, 1, 1, 2015].map(Step::Message)).unwrap();
}
