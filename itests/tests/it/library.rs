//! The checks of this crate's library (`hkvm_itests`): image references, and the
//! NATS authorization that docs/security.md documents.

use hkvm_itests::images::split_image_ref;
use hkvm_itests::security::{nats_conf, ListedNode};

#[test]
fn image_references_split_into_name_and_tag() {
    let cases = [
        ("hkvm/nats:2.15.1", ("hkvm/nats", "2.15.1")),
        ("nats", ("nats", "latest")),
        (
            "registry:5000/team/nats:2.15",
            ("registry:5000/team/nats", "2.15"),
        ),
        ("registry:5000/nats", ("registry:5000/nats", "latest")),
    ];
    for (reference, (name, tag)) in cases {
        assert_eq!(
            split_image_ref(reference),
            (name.to_owned(), tag.to_owned())
        );
    }
}

/// docs/security.md shows the config `nats_conf` generates, verbatim.
#[test]
fn the_documented_config_is_the_generated_one() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/security.md"))
        .unwrap_or_default();
    let node = ListedNode {
        node: "host-a",
        subcluster: "sc-0",
    };
    let generated = nats_conf("prod", &["sc-0", "sc-1"], &[node]).unwrap();
    assert!(
        doc.contains(&generated),
        "docs/security.md must contain the output of nats_conf(\"prod\", [\"sc-0\", \"sc-1\"], \
         [host-a of sc-0]):\n{generated}"
    );
}
