//! Seeded synthetic workloads, the same for tests, benchmarks and `afstream`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

use crate::operators::{FlowPacket, JoinTuple, KeyedValue, LabeledVector, Side};

/// Packets of `flows` flows whose packet counts follow a Zipf law with the given
/// exponent; sizes follow the usual bimodal mix of Internet traffic (about 40% small
/// ACK-sized packets, 40% full 1500-byte frames, the rest in between).
pub fn zipf_flows(packets: usize, flows: u64, exponent: f64, seed: u64) -> Vec<FlowPacket> {
    let mut rng = StdRng::seed_from_u64(seed);
    let zipf = Zipf::new(flows.max(1), exponent).unwrap_or_else(|_| Zipf::new(1, 1.0).expect("valid Zipf"));
    (0..packets)
        .map(|_| {
            let rank = zipf.sample(&mut rng) as u64;
            let bytes = match rng.gen_range(0..10) {
                0..=3 => rng.gen_range(40..=100),
                4..=7 => 1500,
                _ => rng.gen_range(101..1500),
            };
            FlowPacket {
                flow: flow_name(rank).into_bytes(),
                bytes,
            }
        })
        .collect()
}

/// A readable 5-tuple-like flow name for a rank.
pub fn flow_name(rank: u64) -> String {
    let a = (rank >> 16) & 0xff;
    let b = (rank >> 8) & 0xff;
    let c = rank & 0xff;
    format!("10.{a}.{b}.{c}:{}->192.168.0.1:443/tcp", 1024 + rank % 60000)
}

/// Two interleaved streams joining on keys drawn from a Zipf law over `keys` keys.
pub fn join_streams(tuples: usize, keys: u64, seed: u64) -> Vec<JoinTuple> {
    let mut rng = StdRng::seed_from_u64(seed);
    let zipf = Zipf::new(keys.max(1), 0.8).unwrap_or_else(|_| Zipf::new(1, 1.0).expect("valid Zipf"));
    (0..tuples as u64)
        .map(|i| JoinTuple {
            side: if rng.gen_bool(0.5) { Side::Left } else { Side::Right },
            id: i,
            key: zipf.sample(&mut rng) as u64,
            value: rng.gen_range(0.0..100.0),
        })
        .collect()
}

/// Linearly separable labelled vectors with `nonzeros` of `features` features set
/// per item, labelled by known weights (returned) with a margin.
pub fn separable_vectors(items: usize, features: u64, nonzeros: usize, seed: u64) -> (Vec<LabeledVector>, Vec<f64>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let weights: Vec<f64> = (0..features).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let data = (0..items)
        .map(|_| loop {
            let picked: Vec<(u64, f64)> = (0..nonzeros)
                .map(|_| (rng.gen_range(0..features.max(1)), rng.gen_range(-1.0..1.0)))
                .collect();
            let margin: f64 = picked.iter().map(|&(f, x)| weights[f as usize] * x).sum();
            if margin.abs() > 0.05 {
                break LabeledVector {
                    label: margin > 0.0,
                    features: picked,
                };
            }
        })
        .collect();
    (data, weights)
}

/// Text lines of Zipf-distributed words from a vocabulary of `vocabulary` words.
pub fn text_lines(lines: usize, words_per_line: usize, vocabulary: u64, seed: u64) -> Vec<String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let zipf = Zipf::new(vocabulary.max(1), 1.0).unwrap_or_else(|_| Zipf::new(1, 1.0).expect("valid Zipf"));
    (0..lines)
        .map(|_| {
            let n = rng.gen_range(1..=words_per_line.max(1));
            (0..n)
                .map(|_| format!("w{}", zipf.sample(&mut rng) as u64))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// Keyed values over Zipf-distributed keys.
pub fn keyed_values(items: usize, keys: u64, seed: u64) -> Vec<KeyedValue> {
    let mut rng = StdRng::seed_from_u64(seed);
    let zipf = Zipf::new(keys.max(1), 1.0).unwrap_or_else(|_| Zipf::new(1, 1.0).expect("valid Zipf"));
    (0..items)
        .map(|_| KeyedValue {
            key: format!("k{}", zipf.sample(&mut rng) as u64).into_bytes(),
            value: rng.gen_range(-10.0..10.0),
        })
        .collect()
}
