//! The engine over the default model split over 3 CPU ranks (SmolLM2's 9 heads, 3 KV heads and
//! FFN of 1536 divide by 3): the golden prompts submitted together, as a server's clients would,
//! give HF transformers' greedy tokens (`tests/golden/smollm2_greedy.json`; all of its gaps are
//! far above the split's f32 rounding, see `tests/tests/golden.rs`).

use serde_json::Value;
use std::time::Duration;
use turbo_engine::{Device, Engine, EngineConfig, Event, KvSize, ModelOptions, Request};
use turbo_tests::default_model::default_model_path;

#[test]
fn a_split_engine_gives_the_golden_tokens_to_requests_in_flight_together() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/golden/smollm2_greedy.json"
    );
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let engine = Engine::start(EngineConfig {
        kv: KvSize::Blocks(512),
        max_batch: 4,
        ..EngineConfig::new(ModelOptions {
            model: Some(default_model_path().to_path_buf()),
            device: Device::Cpu,
            threads: Some(2),
            progress: false,
            tensor_parallel: 3,
            ..ModelOptions::default()
        })
    })
    .expect("the split engine starts");
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let cases: Vec<&Value> = golden["cases"].as_array().unwrap().iter().collect();
    let mut streams: Vec<_> = cases
        .iter()
        .map(|c| {
            let want = ids(&c["greedy_token_ids"]);
            let request = Request {
                max_tokens: want.len(),
                ignore_eos: true,
                ..Request::new(ids(&c["prompt_token_ids"]))
            };
            (
                c["name"].as_str().unwrap(),
                want,
                engine.submit(request).unwrap(),
            )
        })
        .collect();
    for (name, want, stream) in &mut streams {
        let got = loop {
            match stream.blocking_next() {
                Some(Event::Finished(c)) => break c.token_ids,
                Some(Event::Failed(e)) => panic!("{name}: {e}"),
                Some(_) => {}
                None => panic!("{name}: the stream closed"),
            }
        };
        assert_eq!(&got, want, "{name}");
    }
    engine.shutdown(Duration::from_secs(10));
}
