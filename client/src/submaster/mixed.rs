//! A real client's coalesced metadata calls: the `exist`, `get_replica_list`,
//! `put_start` and `put_end` calls of its dummies, whatever their operation, share
//! one [`Mixed`] request at a time, so a batch holds every call that queued while
//! the previous one was in flight.

use hkvm_events::rpc::submaster::{
    ItemResult, Mixed, MixedReply, Op, PutEndItem, PutStartItem, ReplicaList, ReplicaLocation,
};

use crate::error::ClientError;

use super::SubmasterClient;

/// One item of a coalesced call.
#[derive(Debug)]
pub(super) enum Call {
    /// An `exist` key.
    Exist(String),
    /// A `get_replica_list` key.
    Locate(String),
    /// A `put_start` item.
    Start(PutStartItem),
    /// A `put_end` item.
    End(PutEndItem),
}

/// One item's answer, of the call's operation.
#[derive(Debug)]
pub(super) enum Answer {
    /// An `exist` flag.
    Exist(bool),
    /// A `get_replica_list` result.
    Locate(ItemResult<ReplicaList>),
    /// A `put_start` result.
    Start(ItemResult<Vec<ReplicaLocation>>),
    /// A `put_end` result.
    End(ItemResult<()>),
}

impl Answer {
    /// An `exist` answer's flag.
    pub(super) fn into_exist(self) -> Option<bool> {
        match self {
            Self::Exist(flag) => Some(flag),
            _ => None,
        }
    }

    /// A `get_replica_list` answer's result.
    pub(super) fn into_locate(self) -> Option<ItemResult<ReplicaList>> {
        match self {
            Self::Locate(result) => Some(result),
            _ => None,
        }
    }

    /// A `put_start` answer's result.
    pub(super) fn into_start(self) -> Option<ItemResult<Vec<ReplicaLocation>>> {
        match self {
            Self::Start(result) => Some(result),
            _ => None,
        }
    }

    /// A `put_end` answer's result.
    pub(super) fn into_end(self) -> Option<ItemResult<()>> {
        match self {
            Self::End(result) => Some(result),
            _ => None,
        }
    }
}

/// Which part of the request each call went to, in call order.
#[derive(Debug, Clone, Copy)]
enum Part {
    Exist,
    Locate,
    Start,
    End,
}

/// Gathers calls into one request, remembering their order.
fn gather(calls: Vec<Call>) -> (Mixed, Vec<Part>) {
    let mut mixed = Mixed::default();
    let parts = calls
        .into_iter()
        .map(|call| match call {
            Call::Exist(key) => {
                mixed.exist.push(key);
                Part::Exist
            }
            Call::Locate(key) => {
                mixed.get_replica_list.push(key);
                Part::Locate
            }
            Call::Start(item) => {
                mixed.put_start.push(item);
                Part::Start
            }
            Call::End(item) => {
                mixed.put_end.push(item);
                Part::End
            }
        })
        .collect();
    (mixed, parts)
}

/// Hands each call its answer, in call order; a part answered with another number
/// of items than asked is a [`ClientError::Mismatch`].
fn scatter(reply: MixedReply, parts: &[Part]) -> Result<Vec<Answer>, ClientError> {
    let answered = reply.exist.len()
        + reply.get_replica_list.len()
        + reply.put_start.len()
        + reply.put_end.len();
    let mismatch = || ClientError::Mismatch {
        asked: parts.len(),
        answered,
    };
    let mut exist = reply.exist.into_iter();
    let mut locate = reply.get_replica_list.into_iter();
    let mut start = reply.put_start.into_iter();
    let mut end = reply.put_end.into_iter();
    let answers = parts
        .iter()
        .map(|part| match part {
            Part::Exist => exist.next().map(Answer::Exist),
            Part::Locate => locate.next().map(Answer::Locate),
            Part::Start => start.next().map(Answer::Start),
            Part::End => end.next().map(Answer::End),
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(mismatch)?;
    if answered != parts.len() {
        return Err(mismatch());
    }
    Ok(answers)
}

impl SubmasterClient {
    /// Sends coalesced calls as one [`Mixed`] request. It may be sent again after a
    /// timeout when every commit in it carries its put's id (or it has none).
    pub(super) async fn mixed(&self, calls: Vec<Call>) -> Result<Vec<Answer>, ClientError> {
        let (mixed, parts) = gather(calls);
        let resend = super::commits_resend(&mixed.put_end);
        let reply: MixedReply = self.call_with(Op::Mixed, &mixed, resend).await?;
        scatter(reply, &parts)
    }
}

/// Unwraps answers of one operation, or a [`ClientError::Mismatch`] if any answer
/// is of another operation.
pub(super) fn answers_of<T>(
    answers: Vec<Answer>,
    unwrap: impl Fn(Answer) -> Option<T>,
) -> Result<Vec<T>, ClientError> {
    let asked = answers.len();
    answers
        .into_iter()
        .map(unwrap)
        .collect::<Option<Vec<T>>>()
        .ok_or(ClientError::Mismatch { asked, answered: 0 })
}

#[cfg(test)]
mod tests {
    use hkvm_events::rpc::submaster::ItemError;

    use super::*;

    fn item(key: &str) -> PutEndItem {
        PutEndItem {
            key: key.into(),
            checksum: 1,
            put_id: 0,
        }
    }

    #[test]
    fn answers_come_back_in_call_order_across_parts() {
        let calls = vec![
            Call::End(item("a")),
            Call::Exist("b".into()),
            Call::End(item("c")),
            Call::Exist("d".into()),
        ];
        let (mixed, parts) = gather(calls);
        assert_eq!(mixed.put_end.len(), 2);
        assert_eq!(mixed.exist, vec!["b".to_owned(), "d".to_owned()]);
        let reply = MixedReply {
            exist: vec![true, false],
            put_end: vec![ItemResult::Ok(()), ItemResult::Err(ItemError::NoPendingPut)],
            ..MixedReply::default()
        };
        let answers = scatter(reply, &parts).unwrap();
        assert!(matches!(answers[0], Answer::End(ItemResult::Ok(()))));
        assert!(matches!(answers[1], Answer::Exist(true)));
        assert!(matches!(
            answers[2],
            Answer::End(ItemResult::Err(ItemError::NoPendingPut))
        ));
        assert!(matches!(answers[3], Answer::Exist(false)));
    }

    #[test]
    fn a_short_or_long_part_is_a_mismatch() {
        let (_, parts) = gather(vec![Call::Exist("a".into()), Call::Exist("b".into())]);
        let short = MixedReply {
            exist: vec![true],
            ..MixedReply::default()
        };
        assert!(matches!(
            scatter(short, &parts),
            Err(ClientError::Mismatch {
                asked: 2,
                answered: 1
            })
        ));
        let long = MixedReply {
            exist: vec![true, true],
            put_end: vec![ItemResult::Ok(())],
            ..MixedReply::default()
        };
        assert!(matches!(
            scatter(long, &parts),
            Err(ClientError::Mismatch {
                asked: 2,
                answered: 3
            })
        ));
    }
}
