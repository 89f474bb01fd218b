//! A node's data port serves only what its sub-master granted
//! (docs/security.md, "The data port"): a raw TCP client without a grant, with a
//! forged one, a stretched one, an expired one, one for another range or for the
//! other access reads and writes nothing, while the grant the sub-master handed
//! out works. (Who may read the grant key is in `nats_roles`.)

use hkvm_client::KvClient;
use hkvm_events::grant::{Access, Grant, GrantKey, GrantRequest};
use hkvm_events::rpc::submaster::{ItemResult, ReplicaLocation};
use hkvm_events::SubclusterId;
use hkvm_log::grants;
use hkvm_log::registry::now_unix_ms;
use hkvm_transfer::{ErrorKind, ReadOp, TcpTransport, Transport, WriteOp};

use crate::fixture::{Pool, PoolSpec};

const VALUE_LEN: usize = 4096;

/// The one replica of `key`, as a reader gets it from the sub-master.
async fn replica_of(kv: &KvClient, key: &str) -> ReplicaLocation {
    let mut lists = kv
        .metadata()
        .get_replica_list(vec![key.to_owned()])
        .await
        .unwrap();
    let ItemResult::Ok(list) = lists.remove(0) else {
        panic!("{key} is not listed")
    };
    list.replicas.into_iter().next().unwrap()
}

async fn read(
    raw: &TcpTransport,
    replica: &ReplicaLocation,
    grant: &[u8],
) -> Result<Vec<u8>, ErrorKind> {
    raw.read_batch(
        &replica.endpoint,
        &[ReadOp {
            region: replica.segment.as_str(),
            offset: replica.offset,
            len: VALUE_LEN as u64,
            grant,
        }],
    )
    .await
    .map(|mut values| values.remove(0).to_vec())
    .map_err(|error| error.kind())
}

async fn write(
    raw: &TcpTransport,
    replica: &ReplicaLocation,
    grant: &[u8],
) -> Result<(), ErrorKind> {
    raw.write_batch(
        &replica.endpoint,
        &[WriteOp {
            region: replica.segment.as_str(),
            offset: replica.offset,
            data: &[0xee; VALUE_LEN],
            grant,
        }],
    )
    .await
    .map_err(|error| error.kind())
}

fn signed(
    key: &GrantKey,
    replica: &ReplicaLocation,
    change: impl FnOnce(&mut GrantRequest<'_>),
) -> [u8; 45] {
    let mut request = GrantRequest {
        segment: replica.segment.as_str(),
        access: Access::Read,
        offset: replica.offset,
        len: VALUE_LEN as u64,
        expires_unix_ms: now_unix_ms() + 60_000,
    };
    change(&mut request);
    key.sign(request).to_wire()
}

#[tokio::test]
async fn the_data_port_serves_only_what_the_submaster_granted() {
    let pool = Pool::start(
        PoolSpec::new("grants")
            .subcluster("sc", &[])
            .nodes(1, 16 << 20),
    )
    .await;
    let kv = &pool.kv["sc"];
    let secret = vec![0x5a; VALUE_LEN];
    kv.put("secret", &secret, 1).await.unwrap();
    let replica = replica_of(kv, "secret").await;
    let granted: Grant = replica
        .grant
        .expect("the sub-master grants every replica it lists");
    assert_eq!(granted.access, Access::Read);
    let raw = TcpTransport::default();

    // The grant handed out reads the value (so the refusals below can fail).
    assert_eq!(
        read(&raw, &replica, &granted.to_wire()).await,
        Ok(secret.clone())
    );

    // No grant, one made with another key, and the real one stretched to the
    // whole segment or turned into a write grant: refused.
    let foreign = grants::generate_key();
    let stretched = Grant {
        offset: 0,
        len: 16 << 20,
        ..granted
    };
    let as_write = Grant {
        access: Access::Write,
        ..granted
    };
    for (what, grant) in [
        ("no grant", Vec::new()),
        ("another key", signed(&foreign, &replica, |_| {}).to_vec()),
        ("stretched", stretched.to_wire().to_vec()),
        ("turned into a write", as_write.to_wire().to_vec()),
    ] {
        assert_eq!(
            read(&raw, &replica, &grant).await,
            Err(ErrorKind::Denied),
            "read with {what}"
        );
        assert_eq!(
            write(&raw, &replica, &grant).await,
            Err(ErrorKind::Denied),
            "write with {what}"
        );
    }
    let whole_segment = raw
        .read_batch(
            &replica.endpoint,
            &[ReadOp {
                region: replica.segment.as_str(),
                offset: 0,
                len: 16 << 20,
                grant: &granted.to_wire(),
            }],
        )
        .await
        .unwrap_err();
    assert_eq!(whole_segment.kind(), ErrorKind::Denied);

    // With the real key (read as an operator may): expired, another range, the
    // wrong access.
    let key = grants::read(
        &pool.fixture.js,
        &pool.fixture.cluster,
        &SubclusterId::new("sc").unwrap(),
    )
    .await
    .unwrap();
    let expired = signed(&key, &replica, |r| {
        r.expires_unix_ms = now_unix_ms() - 60_000
    });
    let next_range = signed(&key, &replica, |r| r.offset += VALUE_LEN as u64);
    let read_grant = signed(&key, &replica, |_| {});
    assert_eq!(read(&raw, &replica, &expired).await, Err(ErrorKind::Denied));
    assert_eq!(
        read(&raw, &replica, &next_range).await,
        Err(ErrorKind::Denied)
    );
    assert_eq!(
        write(&raw, &replica, &read_grant).await,
        Err(ErrorKind::Denied)
    );
    assert_eq!(read(&raw, &replica, &read_grant).await, Ok(secret.clone()));

    // Nothing written: the value is intact, for the client and in the segment.
    assert_eq!(kv.get("secret").await.unwrap().value.to_vec(), secret);
    let mut stored = vec![0u8; VALUE_LEN];
    pool.nodes[0]
        .segment()
        .read_at(replica.offset, &mut stored)
        .unwrap();
    assert_eq!(stored, secret);
    pool.shutdown().await;
}
