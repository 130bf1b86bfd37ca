//! `tmem corpus export`: raw pages in order, and a dictionary trained on them.

use std::process::Command;

fn tmem(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tmem")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

#[test]
fn export_writes_the_first_pages_of_each_corpus_in_order_and_a_dictionary() {
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n).to_str().unwrap().to_owned();
    let (python, redis) =
        (tmem_corpus::Corpus::builtin_named("python").unwrap(), tmem_corpus::Corpus::builtin_named("redis").unwrap());
    python.write(dir.path().join("python.tcorp").as_path(), true).unwrap();
    redis.write(dir.path().join("redis.tcorp").as_path(), true).unwrap();
    let (ok, said) = tmem(&[
        "corpus",
        "export",
        &path("python.tcorp"),
        &path("redis.tcorp"),
        "--out",
        &path("pages.raw"),
        "--each",
        "64K",
        "--dictionary",
        &path("pages.dict"),
        "--dict-size",
        "8K",
    ]);
    assert!(ok, "{said}");
    let raw = std::fs::read(path("pages.raw")).unwrap();
    let want: Vec<u8> = python.pages().take(16).chain(redis.pages().take(16)).flatten().copied().collect();
    assert!(raw == want, "32 pages: python's first 16, then redis's ({} bytes)", raw.len());
    let dict = std::fs::read(path("pages.dict")).unwrap();
    assert!(!dict.is_empty() && dict.len() <= 8192, "{} bytes", dict.len());
    assert!(said.contains("32 pages") && said.contains("dictionary from 32 pages"), "{said}");
    // A file that is not there is named.
    let (ok, said) = tmem(&["corpus", "export", &path("none.tcorp"), "--out", &path("x.raw")]);
    assert!(!ok && said.contains("none.tcorp"), "{said}");
}
