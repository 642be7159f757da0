//! Tests of `config`.

use super::*;

const GOOD: &str = r#"
[kafka]
bootstrap_servers = "127.0.0.1:9092"
group_id = "wc"
properties = { "fetch.wait.max.ms" = "10" }

[pipeline]
input_topic = "lines"
output_topic = "counts"
format = "text"

[pipeline.operator]
kind = "word_count"
max_words_per_line = 50

[pipeline.fault_tolerance]
mode = "approximate"
theta = 1000.0
max_uncovered = 500
max_unacked = 500
"#;

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn a_good_file_parses_with_defaults() {
    let config = parse(GOOD, &no_env).expect("valid");
    assert_eq!(config.pipeline.changelog_topic("wc"), "wc-changelog");
    assert_eq!(config.pipeline.dead_letter_topic("wc"), "wc-dead-letters");
    assert_eq!(
        config.kafka.properties.get("fetch.wait.max.ms").map(String::as_str),
        Some("10")
    );
    assert_eq!(config.pipeline.fault_tolerance.failure_policy(), FailurePolicy::Halving);
    match config.pipeline.operator {
        OperatorConfig::WordCount(wc) => assert_eq!(wc.max_words_per_line, 50),
        other => panic!("wrong operator {other:?}"),
    }
}

#[test]
fn the_environment_overrides_the_bootstrap_servers_and_the_metrics_address() {
    let env = |key: &str| match key {
        ENV_BOOTSTRAP_SERVERS => Some("broker:1234".to_string()),
        super::super::metrics::ENV_METRICS_ADDRESS => Some("127.0.0.1:9464".to_string()),
        _ => None,
    };
    let config = parse(GOOD, &env).expect("valid");
    assert_eq!(config.kafka.bootstrap_servers, "broker:1234");
    assert_eq!(config.metrics.map(|m| m.address).as_deref(), Some("127.0.0.1:9464"));
    let bad = format!("{GOOD}\n[metrics]\naddress = \"localhost\"\n");
    assert!(parse(&bad, &no_env).unwrap_err().contains("metrics.address"));
}

#[test]
fn unknown_keys_and_bad_values_name_the_key() {
    let unknown = GOOD.replace("max_words_per_line", "max_words");
    assert!(parse(&unknown, &no_env).unwrap_err().contains("max_words"));
    let negative = GOOD.replace("theta = 1000.0", "theta = -1.0");
    assert!(parse(&negative, &no_env).unwrap_err().contains("theta"));
    let text = GOOD.replace(
        "kind = \"word_count\"\nmax_words_per_line = 50",
        "kind = \"heavy_hitters\"",
    );
    let error = parse(&text, &no_env).unwrap_err();
    assert!(
        error.contains("pipeline.format") && error.contains("heavy_hitters"),
        "{error}"
    );
    let pattern = GOOD.replace(
        "kind = \"word_count\"\nmax_words_per_line = 50",
        "kind = \"grep\"\npattern = \"(a\"",
    );
    assert!(parse(&pattern, &no_env)
        .unwrap_err()
        .contains("pipeline.operator.pattern"));
    let same = GOOD.replace("output_topic = \"counts\"", "output_topic = \"lines\"");
    assert!(parse(&same, &no_env).unwrap_err().contains("must differ"));
    let dead = GOOD.replace(
        "format = \"text\"",
        "format = \"text\"\ndead_letter_topic = \"wc-changelog\"",
    );
    assert!(parse(&dead, &no_env)
        .unwrap_err()
        .contains("dead-letter (wc-changelog)"));
    let interval = GOOD.replace("max_unacked = 500", "max_unacked = 500\nexact_interval_ms = 100");
    assert!(parse(&interval, &no_env).unwrap_err().contains("exact_interval"));
}

#[test]
fn avro_settings_are_checked() {
    let avro = GOOD.replace("format = \"text\"", "format = \"avro\"");
    let config = parse(&avro, &no_env).expect("Avro with the defaults");
    assert_eq!(config.pipeline.avro, None);
    let framed = format!("{avro}\n[pipeline.avro]\ninput_schema_id = 3\noutput_schema_id = 4\n");
    let config = parse(&framed, &no_env).expect("framed");
    let settings = config.pipeline.avro.expect("[pipeline.avro]");
    assert_eq!(settings.input_framing, Framing::Confluent);
    assert_eq!(
        (settings.input_schema_id, settings.output_schema_id),
        (Some(3), Some(4))
    );
    let plain_with_id = format!("{avro}\n[pipeline.avro]\ninput_framing = \"plain\"\ninput_schema_id = 3\n");
    assert!(parse(&plain_with_id, &no_env)
        .unwrap_err()
        .contains("pipeline.avro.input_schema_id"));
    let not_avro = format!("{GOOD}\n[pipeline.avro]\noutput_schema_id = 4\n");
    assert!(parse(&not_avro, &no_env).unwrap_err().contains("[pipeline.avro]"));
    let unknown = format!("{avro}\n[pipeline.avro]\nschema_registry = \"http://x\"\n");
    assert!(parse(&unknown, &no_env).unwrap_err().contains("schema_registry"));
}

const TWO: &str = r#"
[kafka]
bootstrap_servers = "127.0.0.1:9092"
group_id = "analytics"

[pipelines.counts]
input_topic = "lines"
output_topic = "counts"
format = "text"
operator = { kind = "word_count" }
fault_tolerance = { mode = "approximate", theta = 1000.0, max_uncovered = 500, max_unacked = 500 }

[pipelines.errors]
group_id = "error-lines"
input_topic = "lines"
output_topic = "errors"
format = "text"
operator = { kind = "grep", pattern = "error" }
fault_tolerance = { mode = "none", theta = 1.0, max_uncovered = 500, max_unacked = 500 }
"#;

#[test]
fn a_file_of_several_pipelines_gives_each_its_own_group() {
    let configs = parse_all(TWO, &no_env).expect("valid");
    let groups: Vec<(&str, &str)> = configs
        .iter()
        .map(|c| (c.name.as_deref().unwrap_or(""), c.kafka.group_id.as_str()))
        .collect();
    assert_eq!(groups, [("counts", "analytics-counts"), ("errors", "error-lines")]);
    assert_eq!(
        configs[0].pipeline.changelog_topic(&configs[0].kafka.group_id),
        "analytics-counts-changelog"
    );
    let error = parse(TWO, &no_env).unwrap_err();
    assert!(error.contains("2 pipelines (counts, errors)"), "{error}");

    let bad = TWO.replace("pattern = \"error\"", "pattern = \"(error\"");
    let error = parse_all(&bad, &no_env).unwrap_err();
    assert!(error.contains("`pipelines.errors.operator.pattern`"), "{error}");
    let shared = TWO.replace("group_id = \"error-lines\"", "group_id = \"analytics-counts\"");
    assert!(parse_all(&shared, &no_env)
        .unwrap_err()
        .contains("share the consumer group analytics-counts"));
    let unnamed_group = TWO.replace("group_id = \"analytics\"", "");
    assert!(parse_all(&unnamed_group, &no_env)
        .unwrap_err()
        .contains("pipelines.counts.group_id"));
    let both = format!("{GOOD}\n{}", &TWO[TWO.find("[pipelines.counts]").expect("table")..]);
    assert!(parse_all(&both, &no_env).unwrap_err().contains("not both"));
    let none = "[kafka]\nbootstrap_servers = \"b:9092\"\ngroup_id = \"g\"\n";
    assert!(parse_all(none, &no_env).unwrap_err().contains("no pipeline"));
}

const CHAIN: &str = r#"
[kafka]
bootstrap_servers = "127.0.0.1:9092"
group_id = "wc2"

[pipelines.tokenize]
input_topic = "lines"
output_topic = "words"
format = "text"
operator = { kind = "tokenize", max_words_per_line = 8 }

[pipelines.count]
input_topic = "words"
output_topic = "counts"
format = "text"
operator = { kind = "keyed_aggregation" }
fault_tolerance = { mode = "approximate", theta = 800.0, max_uncovered = 100, max_unacked = 800 }
"#;

#[test]
fn pipelines_reading_each_others_output_form_a_chain_with_the_last_stages_thresholds() {
    let configs = parse_all(CHAIN, &no_env).expect("valid");
    let stages: Vec<(Option<&str>, Option<&Stage>)> =
        configs.iter().map(|c| (c.name.as_deref(), c.stage.as_ref())).collect();
    let chain = vec!["tokenize".to_string(), "count".to_string()];
    let operators = vec![
        OperatorConfig::Tokenize(TokenizeConfig { max_words_per_line: 8 }),
        OperatorConfig::KeyedAggregation(KeyedAggregationConfig::default()),
    ];
    assert_eq!(
        stages,
        [
            (
                Some("tokenize"),
                Some(&Stage {
                    index: 1,
                    stages: 2,
                    chain: chain.clone(),
                    operators: operators.clone(),
                })
            ),
            (
                Some("count"),
                Some(&Stage {
                    index: 2,
                    stages: 2,
                    chain,
                    operators,
                })
            ),
        ],
        "in chain order, whatever the names' order"
    );
    assert_eq!(
        configs[0].pipeline.fault_tolerance.theta, 800.0,
        "the chain's thresholds"
    );
    assert_eq!(
        configs.iter().map(Config::source_positions).collect::<Vec<_>>(),
        [true, false],
        "positions on the outputs a later stage reads"
    );
    let forced = CHAIN.replace(
        "operator = { kind = \"tokenize\", max_words_per_line = 8 }",
        "operator = { kind = \"tokenize\", max_words_per_line = 8 }\nsource_positions = false",
    );
    let forced = parse_all(&forced, &no_env).expect("valid");
    assert!(!forced[0].source_positions(), "as configured");

    let own = CHAIN.replace(
        "operator = { kind = \"tokenize\", max_words_per_line = 8 }",
        "operator = { kind = \"tokenize\", max_words_per_line = 8 }\nfault_tolerance = { mode = \"none\", theta = 1.0, max_uncovered = 1, max_unacked = 8 }",
    );
    let error = parse_all(&own, &no_env).unwrap_err();
    assert!(
        error.contains("`pipelines.tokenize.fault_tolerance`") && error.contains("last stage's"),
        "{error}"
    );
    let missing = CHAIN.replace(
        "fault_tolerance = { mode = \"approximate\", theta = 800.0, max_uncovered = 100, max_unacked = 800 }",
        "",
    );
    assert!(parse_all(&missing, &no_env)
        .unwrap_err()
        .contains("`pipelines.count.fault_tolerance` is missing"));
    let fan_out = format!(
        "{CHAIN}\n[pipelines.other]\ninput_topic = \"words\"\noutput_topic = \"other\"\nformat = \"text\"\n\
         operator = {{ kind = \"grep\", pattern = \"a\" }}\nfault_tolerance = {{ mode = \"none\", theta = 1.0, \
         max_uncovered = 1, max_unacked = 1 }}\n"
    );
    assert!(parse_all(&fan_out, &no_env)
        .unwrap_err()
        .contains("both read words, the output of tokenize"));
    let cycle = CHAIN.replace("input_topic = \"lines\"", "input_topic = \"counts\"");
    assert!(parse_all(&cycle, &no_env).unwrap_err().contains("cycle"));
}

#[test]
fn a_pipeline_of_a_file_is_picked_by_name() {
    let dir = std::env::temp_dir().join(format!("afstream-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("two.toml");
    std::fs::write(&path, TWO).expect("write");
    let errors = load_named(&path, &no_env, Some("errors")).expect("named");
    assert_eq!(errors.pipeline.output_topic, "errors");
    let error = load_named(&path, &no_env, Some("nope")).unwrap_err().to_string();
    assert!(
        error.contains("no pipeline named \"nope\" (it has: counts, errors)"),
        "{error}"
    );
    let error = load(&path, &no_env).unwrap_err().to_string();
    assert!(error.contains("--pipeline") && error.contains("two.toml"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn empty_names_and_impossible_replication_are_refused_by_key() {
    let empty = GOOD.replace("input_topic = \"lines\"", "input_topic = \" \"");
    assert!(parse(&empty, &no_env)
        .unwrap_err()
        .contains("`pipeline.input_topic` is empty"));
    let group = GOOD.replace("group_id = \"wc\"", "group_id = \"\"");
    assert!(parse(&group, &no_env)
        .unwrap_err()
        .contains("`kafka.group_id` is empty"));
    let replicas = GOOD.replace("group_id = \"wc\"", "group_id = \"wc\"\nreplication_factor = 0");
    assert!(parse(&replicas, &no_env)
        .unwrap_err()
        .contains("`kafka.replication_factor` = 0"));
    let policy = GOOD.replace("max_unacked = 500", "max_unacked = 500\npolicy = \"sometimes\"");
    assert!(parse(&policy, &no_env).unwrap_err().contains("sometimes"));
}

#[test]
fn the_shipped_configs_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("configs/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            load_all(&path, &no_env).unwrap_or_else(|e| panic!("{e}"));
            checked += 1;
        }
    }
    assert!(checked >= 2, "configs/ holds {checked} configs");
}
