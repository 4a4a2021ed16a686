//! What docs.rs is told: every feature built, and each feature-gated item badged with the
//! feature it needs (so `.redis(..)` shows "Available on crate feature redis only" instead of
//! leaving "no method named `redis`" a puzzle). Only a stable toolchain runs the tests, so
//! this checks the settings that make nightly rustdoc draw the badges.

/// The text of `path` in this package.
fn read(path: &str) -> String {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// The lines of `toml`'s `[table]`, trimmed, until the next table.
fn table<'a>(toml: &'a str, table: &str) -> Vec<&'a str> {
    let header = format!("[{table}]");
    toml.lines()
        .map(str::trim)
        .skip_while(|l| *l != header)
        .skip(1)
        .take_while(|l| !l.starts_with('['))
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

#[test]
fn docs_rs_badges_each_feature_gated_item_with_its_feature() {
    let manifest = read("Cargo.toml");
    let docs_rs = table(&manifest, "package.metadata.docs.rs");
    assert!(docs_rs.contains(&"all-features = true"), "{docs_rs:?}");
    assert!(
        docs_rs.contains(&r#"rustdoc-args = ["--cfg", "docsrs"]"#),
        "{docs_rs:?}"
    );
    // `docsrs` is a cfg the compiler knows, so stable builds do not warn about it.
    let lints = table(&manifest, "lints.rust");
    assert!(
        lints
            .iter()
            .any(|l| l.starts_with("unexpected_cfgs") && l.contains("cfg(docsrs)")),
        "{lints:?}"
    );
    let lib = read("src/lib.rs");
    assert!(
        lib.lines()
            .any(|l| l.trim() == "#![cfg_attr(docsrs, feature(doc_cfg))]"),
        "src/lib.rs turns on doc_cfg for docs.rs"
    );
}
