//! The `afstream` command without a broker: `afstream check` on the shipped
//! configs and on broken ones, `afstream tune` on a file.

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

/// The shipped WordCount config tuned on a text file for a 1 % budget: the
/// written Θ is the recommended one and keeps the bound after any number of
/// failures (Θ itself, for one task's counts) within 1 % of the words,
/// computed here; the file keeps its comments and still checks.
#[test]
fn tune_writes_thresholds_within_the_budget_into_the_config_and_keeps_its_comments() {
    let dir = std::env::temp_dir().join(format!("afstream-cli-tune-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/word-count.toml"))
        .expect("the shipped WordCount config");
    let config = dir.join("word-count.toml");
    std::fs::write(&config, &shipped).expect("write the config");
    let lines: Vec<String> = (0..3000)
        .map(|i| format!("the {} word{} of line {}", i % 7, i % 31, i % 5))
        .collect();
    let words: usize = lines.iter().map(|l| l.split_whitespace().count()).sum();
    let input = dir.join("lines.txt");
    std::fs::write(&input, lines.join("\n")).expect("write the lines");
    let (config_arg, input_arg) = (config.to_string_lossy(), input.to_string_lossy());
    let refused = afstream(&["tune", "--config", &config_arg, "--error", "1 percent"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("percentage (0.5%)"));
    let output = afstream(&[
        "tune",
        "--config",
        &config_arg,
        "--error",
        "1%",
        "--input",
        &input_arg,
        "--write",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        stdout.contains("3000 records, 0 refused") && stdout.contains("\n* "),
        "{stdout}"
    );
    let written = std::fs::read_to_string(&config).expect("the tuned config");
    let theta: f64 = written
        .lines()
        .find_map(|line| line.strip_prefix("theta = ")?.split_whitespace().next()?.parse().ok())
        .expect("theta");
    assert!(
        theta > 0.0 && theta <= 0.01 * words as f64,
        "Θ {theta} for {words} words"
    );
    let recommended = stdout.lines().find(|l| l.starts_with("* ")).expect("a recommended row");
    assert_eq!(recommended.split_whitespace().nth(1), Some(theta.to_string().as_str()));
    let comments = |text: &str| text.lines().filter(|l| l.trim_start().starts_with('#')).count();
    assert_eq!(comments(&written), comments(&shipped));
    assert!(afstream(&["check", "--config", &config_arg]).status.success());
    std::fs::remove_dir_all(&dir).expect("remove the directory");
}
