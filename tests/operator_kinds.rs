//! The registry of operator kinds, walked: every kind `OperatorConfig` lists
//! has a shipped config in `configs/` that runs it, schemas that parse, a
//! codec for that config's format, a producer workload whose records that
//! codec reads, and an exact answer that takes them. A kind added without
//! one of these fails here (or does not compile: `with_operator!` needs
//! every kind's `ServiceOperator` and `Answering`).

use std::path::{Path, PathBuf};

use afstream::eval::exact::{Answering, ExactState};
use afstream::eval::produce::Encoder;
use afstream::service::codec::{Codec, ServiceOperator};
use afstream::service::config::{load_all, Config, OperatorKind};
use strum::IntoEnumIterator;

/// Every pipeline of every config in `configs/`, with its file and the
/// pipelines beside it.
fn shipped() -> Vec<(PathBuf, Config, Vec<Config>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut pipelines = Vec::new();
    let entries = std::fs::read_dir(&dir).expect("configs/");
    for path in entries.map(|e| e.expect("an entry").path()) {
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let file = load_all(&path, &|_| None).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for config in &file {
            pipelines.push((path.clone(), config.clone(), file.clone()));
        }
    }
    pipelines
}

#[test]
fn every_operator_kind_has_a_config_schemas_a_codec_a_producer_workload_and_an_exact_answer() {
    let shipped = shipped();
    let kinds: Vec<OperatorKind> = OperatorKind::iter().collect();
    assert!(kinds.len() >= 9, "the kinds are listed: {kinds:?}");
    for kind in kinds {
        let name: &'static str = kind.into();
        // A pipeline that reads what no other pipeline of its file writes,
        // where one exists: the producer's records are its input.
        let runs_it = |c: &Config| OperatorKind::from(&c.pipeline.operator) == kind;
        let fed = |c: &Config, file: &[Config]| file.iter().any(|o| o.pipeline.output_topic == c.pipeline.input_topic);
        let found = shipped
            .iter()
            .filter(|(_, c, _)| runs_it(c))
            .min_by_key(|(_, c, file)| fed(c, file))
            .unwrap_or_else(|| panic!("no config in configs/ runs {name}"));
        let (path, config, file) = found;
        assert_eq!(config.pipeline.operator.kind(), name);
        let reads_produced = !fed(config, file);
        let taken = afstream::with_operator!(&config.pipeline.operator, |O, c| {
            walk::<O>(config, c, reads_produced)
        });
        if reads_produced {
            assert!(taken > 0, "{name} ({}): no produced record was taken", path.display());
        }
    }
}

/// Checks one kind on its shipped config; how many produced records its
/// exact answer took (0 where its input is another pipeline's output).
fn walk<O: ServiceOperator + Answering>(config: &Config, operator_config: &O::Config, reads_produced: bool) -> usize {
    let kind = config.pipeline.operator.kind();
    for schema in [O::INPUT_SCHEMA, O::OUTPUT_SCHEMA] {
        apache_avro::Schema::parse_str(schema).unwrap_or_else(|e| panic!("{kind}: a schema does not parse: {e}"));
    }
    let codec = Codec::new::<O>(&config.pipeline).unwrap_or_else(|e| panic!("{kind}: no codec: {e}"));
    let operator = O::build(operator_config, None).unwrap_or_else(|e| panic!("{kind}: does not build: {e}"));
    let mut state = O::start(operator, 1);
    if !reads_produced {
        return 0;
    }
    let encoder = Encoder::new(O::WORKLOAD, config.pipeline.format, config.pipeline.avro.as_ref())
        .unwrap_or_else(|e| panic!("{kind}: no producer for its workload {:?}: {e}", O::WORKLOAD));
    let records = encoder
        .synthetic(50, 7)
        .unwrap_or_else(|e| panic!("{kind}: no synthetic records: {e}"));
    let (mut input, mut outputs, mut taken) = (O::empty_input(), Vec::new(), 0);
    for record in &records {
        codec
            .decode::<O>(record.key.as_deref(), &record.value, &mut input)
            .unwrap_or_else(|e| panic!("{kind}: a produced record does not decode: {e}"));
        taken += usize::from(state.take(0, &input, &mut outputs));
    }
    let _ = state.answer(config);
    taken
}
