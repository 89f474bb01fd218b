//! A real client's coalesced metadata calls: the `exist`, `get_replica_list`,
//! `put_start`, `put_end` and `put_commit` calls of its dummies, whatever their
//! operation, share one [`Mixed`] request at a time, so a batch holds every call
//! that queued while the previous one was in flight.

use hkvm_events::rpc::submaster::{
    ItemError, ItemResult, Mixed, MixedReply, Op, PutCommitItem, PutEndItem, PutStartItem,
    ReplicaList, ReplicaLocation,
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
    /// A `put_commit` item.
    Commit(PutCommitItem),
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
    /// A `put_commit` result.
    Commit(ItemResult<()>),
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

    /// A `put_commit` answer's result.
    pub(super) fn into_commit(self) -> Option<ItemResult<()>> {
        match self {
            Self::Commit(result) => Some(result),
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
    Commit,
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
            Call::Commit(item) => {
                mixed.put_commit.push(item);
                Part::Commit
            }
        })
        .collect();
    (mixed, parts)
}

/// Hands each call its answer, in call order; a part answered with another number
/// of items than asked is a [`ClientError::Mismatch`]. A commit part answered not
/// at all comes from a sub-master that predates it and skipped it: each of its
/// items is [`ItemError::NoLease`] (that leader holds no lease and committed
/// nothing), so the put goes through `put_start` / `put_end` instead.
fn scatter(mut reply: MixedReply, parts: &[Part]) -> Result<Vec<Answer>, ClientError> {
    let commits = parts.iter().filter(|p| matches!(p, Part::Commit)).count();
    if commits > 0 && reply.put_commit.is_empty() {
        reply.put_commit = vec![ItemResult::Err(ItemError::NoLease); commits];
    }
    let answered = reply.exist.len()
        + reply.get_replica_list.len()
        + reply.put_start.len()
        + reply.put_end.len()
        + reply.put_commit.len();
    let mismatch = || ClientError::Mismatch {
        asked: parts.len(),
        answered,
    };
    let mut exist = reply.exist.into_iter();
    let mut locate = reply.get_replica_list.into_iter();
    let mut start = reply.put_start.into_iter();
    let mut end = reply.put_end.into_iter();
    let mut commit = reply.put_commit.into_iter();
    let answers = parts
        .iter()
        .map(|part| match part {
            Part::Exist => exist.next().map(Answer::Exist),
            Part::Locate => locate.next().map(Answer::Locate),
            Part::Start => start.next().map(Answer::Start),
            Part::End => end.next().map(Answer::End),
            Part::Commit => commit.next().map(Answer::Commit),
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
        let resend = super::commits_resend(
            mixed
                .put_end
                .iter()
                .map(|item| item.put_id)
                .chain(mixed.put_commit.iter().map(|item| item.put_id)),
        );
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
    fn a_commit_part_an_older_sub_master_skipped_reads_as_no_lease() {
        let commit = PutCommitItem {
            key: "c".into(),
            size: 64,
            checksum: 1,
            lease: 5,
            offset: 0,
            hard_pin: false,
            put_id: 2,
        };
        let (mixed, parts) = gather(vec![
            Call::Commit(commit.clone()),
            Call::Exist("e".into()),
            Call::Commit(PutCommitItem {
                key: "d".into(),
                ..commit
            }),
        ]);
        assert_eq!(mixed.put_commit.len(), 2);
        let skipped = MixedReply {
            exist: vec![true],
            ..MixedReply::default()
        };
        let answers = scatter(skipped, &parts).unwrap();
        assert!(matches!(
            answers[0],
            Answer::Commit(ItemResult::Err(ItemError::NoLease))
        ));
        assert!(matches!(answers[1], Answer::Exist(true)));
        assert!(matches!(
            answers[2],
            Answer::Commit(ItemResult::Err(ItemError::NoLease))
        ));
        let answered = MixedReply {
            exist: vec![false],
            put_commit: vec![
                ItemResult::Ok(()),
                ItemResult::Err(ItemError::AlreadyExists),
            ],
            ..MixedReply::default()
        };
        let answers = scatter(answered, &parts).unwrap();
        assert!(matches!(answers[0], Answer::Commit(ItemResult::Ok(()))));
        assert!(matches!(
            answers[2],
            Answer::Commit(ItemResult::Err(ItemError::AlreadyExists))
        ));
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
