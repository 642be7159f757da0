//! The `afstream` command without a broker: `afstream check` on the shipped
//! configs and on broken ones.

use std::process::{Command, Output};

fn afstream(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_afstream"))
        .args(args)
        .env_remove("AFSTREAM_BOOTSTRAP_SERVERS")
        .env_remove("AFSTREAM_METRICS_ADDRESS")
        .output()
        .expect("run afstream")
}

#[test]
fn check_accepts_every_shipped_config_and_prints_the_thresholds_it_runs_with() {
    let configs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut checked = 0;
    for entry in std::fs::read_dir(&configs).expect("configs/") {
        let path = entry.expect("an entry").path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let output = afstream(&["check", "--config", &path.to_string_lossy(), "--partitions", "3"]);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(stdout.contains("valid") && stdout.contains("for 3 task(s)"), "{stdout}");
        assert!(stdout.contains("state error <="), "{stdout}");
        checked += 1;
    }
    assert!(checked >= 2, "{checked} configs checked");
}

#[test]
fn check_refuses_a_bad_config_naming_the_key_and_the_reason() {
    let dir = std::env::temp_dir().join(format!("afstream-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let good = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/word-count.toml"))
        .expect("the shipped WordCount config");
    for (broken, key) in [
        (
            good.replace("max_uncovered = 1000", "max_uncoverd = 1000"),
            "max_uncoverd",
        ),
        (good.replace("theta = 10000.0", "theta = -5.0"), "theta"),
        (
            good.replace(
                "format = \"text\"",
                "format = \"avro\"\navro = { input_schema = \"no-such.avsc\" }",
            ),
            "pipeline.avro.input_schema",
        ),
    ] {
        let path = dir.join("broken.toml");
        std::fs::write(&path, broken).expect("write the config");
        let output = afstream(&["check", "--config", &path.to_string_lossy()]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "a config with a bad {key} passed");
        assert!(
            stderr.contains(key) && stderr.contains(&path.display().to_string()),
            "the error names {key} and the file: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
