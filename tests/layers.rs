//! The crates' dependencies point down the layers only. Cargo already refuses a cycle;
//! this also refuses an arrow sideways (the store using PG, or PG the store) or from a
//! layer to one that is not below it, which would compile.

use std::path::Path;

/// Each crate, and the `mooncake-*` crates it may depend on.
const LAYERS: &[(&str, &str, &[&str])] = &[
    ("ffi", "mooncake-sys", &[]),
    ("crates/base", "mooncake-base", &["mooncake-sys"]),
    (
        "crates/engine",
        "mooncake-engine",
        &["mooncake-sys", "mooncake-base"],
    ),
    (
        "crates/store",
        "mooncake-store",
        &["mooncake-sys", "mooncake-base", "mooncake-engine"],
    ),
    (
        "crates/collective",
        "mooncake-collective",
        &["mooncake-sys", "mooncake-base", "mooncake-engine"],
    ),
    (
        "crates/cli",
        "mooncake-cli",
        &[
            "mooncake-sys",
            "mooncake-base",
            "mooncake-engine",
            "mooncake-store",
            "mooncake-collective",
        ],
    ),
    (
        "bench",
        "mooncake-bench",
        &[
            "mooncake-sys",
            "mooncake-base",
            "mooncake-engine",
            "mooncake-store",
            "mooncake-collective",
            "mooncake-cli",
        ],
    ),
];

/// The package name and the `mooncake-*` names a manifest depends on (normal, dev and
/// build dependencies alike: a sideways arrow in any of them is one).
fn package_and_layers(manifest: &str) -> (String, Vec<String>) {
    let mut section = "";
    let mut name = String::new();
    let mut deps = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim();
        if section == "[package]" && key == "name" {
            name = value.trim().trim_matches('"').to_owned();
        } else if DEPENDENCY_SECTIONS.contains(&section) && key.starts_with("mooncake") {
            deps.push(key.to_owned());
        }
    }
    (name, deps)
}

const DEPENDENCY_SECTIONS: &[&str] = &[
    "[dependencies]",
    "[dev-dependencies]",
    "[build-dependencies]",
];

#[test]
fn each_crate_depends_only_on_layers_below_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (dir, expected_name, allowed) in LAYERS {
        let path = root.join(dir).join("Cargo.toml");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let (name, deps) = package_and_layers(&text);
        assert_eq!(&name, expected_name, "{}", path.display());
        for dep in &deps {
            assert!(
                allowed.contains(&dep.as_str()),
                "{name} depends on {dep}, which is not a layer below it"
            );
        }
    }
}

#[test]
fn the_manifest_reader_sees_a_sideways_arrow() {
    let manifest = "[package]\nname = \"mooncake-store\"\n\n[dependencies]\n\
                    mooncake-engine = { path = \"../engine\" }\nlibc.workspace = true\n\n\
                    [dev-dependencies]\nmooncake-collective = { path = \"../collective\" }\n\n\
                    [lints]\nworkspace = true\n";
    let (name, deps) = package_and_layers(manifest);
    assert_eq!(name, "mooncake-store");
    assert_eq!(deps, ["mooncake-engine", "mooncake-collective"]);
    let store_allowed = LAYERS[3].2;
    assert!(!store_allowed.contains(&"mooncake-collective"));
}

#[test]
fn every_workspace_member_is_checked() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("Cargo.toml")).expect("the top manifest");
    let members = text
        .split_once("\nmembers = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .expect("a members list");
    for member in members.split(',').map(|m| m.trim().trim_matches('"')) {
        if member.is_empty() {
            continue;
        }
        assert!(
            LAYERS.iter().any(|(dir, _, _)| *dir == member),
            "workspace member {member} has no place in the layers"
        );
    }
}

/// The top package depends on the CLI and the benchmarks for its `mooncake` binary only
/// (the tests run that binary, so it lives in the same package): the library, the C
/// ABI, must not use them.
#[test]
fn the_c_abi_library_does_not_use_the_cli_or_the_benchmarks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("src/lib.rs")];
    let mut dirs = vec![root.join("src/capi")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/capi is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    assert!(files.len() > 5, "found the library's sources: {files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a readable source file");
        for upper in ["mooncake_cli", "mooncake_bench"] {
            assert!(
                !text.contains(upper),
                "{} uses {upper}, which sits above the C ABI",
                file.display()
            );
        }
    }
}
