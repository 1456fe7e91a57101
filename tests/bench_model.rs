//! `bench_model::run` end to end on a tiny random model saved as a HF
//! folder in a temp dir (no downloads): every row is filled, timings are
//! positive, and each sequence decodes exactly `new_tokens` tokens.

mod common;

use actguide::dev::bench_model::{run, ModelBenchConfig, ModelBenchError};
use actguide::model::Policy;
use candle_core::Device;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn tiny_model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let p =
        Policy::new_random(&common::tiny_llama_config(100, 128), &mut rng, &Device::Cpu).unwrap();
    p.save_hf_dir(dir.path(), None).unwrap();
    dir
}

#[test]
fn bench_model_rows_on_a_tiny_model() {
    let dir = tiny_model_dir();
    let cfg = ModelBenchConfig {
        model: dir.path().to_path_buf(),
        batches: vec![1, 2],
        prompt_len: 5,
        new_tokens: 4,
        train_len: 6,
        repeats: 2,
        seed: 3,
        ..Default::default()
    };
    let r = run(&cfg).unwrap();
    assert_eq!(r.vocab_size, 100);
    assert!(r.params > 0 && r.threads >= 1);
    assert_eq!(r.rows.len(), 2);
    for (row, b) in r.rows.iter().zip([1, 2]) {
        assert_eq!(row.batch, b);
        assert_eq!((row.prompt_len, row.new_tokens, row.train_len), (5, 4, 6));
        assert_eq!(
            row.generated_tokens,
            b * 4,
            "every sequence decodes N tokens"
        );
        for x in [
            row.decode_tok_s,
            row.prefill_s,
            row.generate_s,
            row.train_tok_s,
            row.train_s,
            row.optimizer_s,
        ] {
            assert!(x.is_finite() && x > 0.0, "{row:?}");
        }
        assert!(row.optimizer_s < row.train_s);
        assert_eq!(row.generate_s_runs.len(), 2);
        assert_eq!(row.train_s_runs.len(), 2);
        assert!(row.train_loss.is_finite() && row.train_loss > 0.0);
    }
    // The report serialises, and prints one table line per batch size
    // (then, where generation packed its weights, their size).
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["rows"].as_array().unwrap().len(), 2);
    let text = r.to_string();
    let packed = text
        .lines()
        .filter(|l| l.starts_with("packed weights for decode: "))
        .count();
    assert_eq!(packed, usize::from(r.rollout_packed_bytes.is_some()));
    assert_eq!(
        text.lines().filter(|l| !l.is_empty()).count(),
        6 + 1 + 2 + packed
    );
}

#[test]
fn bench_model_refuses_bad_inputs() {
    let dir = tiny_model_dir();
    let bad = ModelBenchConfig {
        model: dir.path().to_path_buf(),
        batches: vec![0],
        ..Default::default()
    };
    assert!(matches!(
        run(&bad),
        Err(ModelBenchError::InvalidArgument(_))
    ));
    let not_model = ModelBenchConfig {
        model: dir.path().join("config.json"),
        ..Default::default()
    };
    assert!(matches!(
        run(&not_model),
        Err(ModelBenchError::NotAModel(_))
    ));
}

/// `dev bench-grpo` end to end on the tiny model, LoRA and full training:
/// every step generates exactly `prompts × group × new_tokens` tokens,
/// trains (the LoRA adapters move), and reports positive timings whose
/// parts add up; bad prompt files are refused with the file named.
#[test]
fn bench_grpo_steps_on_a_tiny_model() {
    use actguide::dev::bench_grpo::{run as grpo, GrpoBenchConfig, GrpoBenchError};
    let dir = tiny_model_dir();
    for lora in [true, false] {
        let mut cfg = GrpoBenchConfig {
            model: dir.path().to_path_buf(),
            prompts: 2,
            prompt_len: 5,
            group: 3,
            new_tokens: 4,
            steps: 2,
            micro_batch: 4,
            lr: 1e-3,
            ..Default::default()
        };
        if !lora {
            cfg.lora = None;
        }
        let r = grpo(&cfg).unwrap();
        assert_eq!(r.steps.len(), 2);
        assert_eq!(r.prompt_tokens, vec![5, 5]);
        assert!(r.trainable_params > 0);
        if lora {
            assert!(r.trainable_params < 10_000, "{}", r.trainable_params);
        }
        for s in &r.steps {
            assert_eq!(s.generated_tokens, 2 * 3 * 4);
            assert!(s.generate_s > 0.0 && s.update_s > 0.0);
            assert!((s.generate_s + s.update_s - s.step_s).abs() < 0.05 * s.step_s + 1e-3);
            assert!((0.0..=1.0).contains(&s.mean_reward));
        }
        assert!(r.fastest.step_s <= r.mean_step_s + 1e-12);
        assert!(r.kernels.contains("rollout weights f32"), "{}", r.kernels);
    }
    // A prompt file with an id outside the vocabulary.
    let bad = dir.path().join("prompts.json");
    std::fs::write(&bad, "[[1, 2, 3], [5, 1000]]").unwrap();
    let cfg = GrpoBenchConfig {
        model: dir.path().to_path_buf(),
        prompt_file: Some(bad.clone()),
        prompts: 2,
        steps: 1,
        ..Default::default()
    };
    match grpo(&cfg) {
        Err(e @ GrpoBenchError::Prompts { .. }) => {
            let m = e.to_string();
            assert!(m.contains("prompts.json") && m.contains("1000"), "{m}");
        }
        other => panic!("{other:?}"),
    }
}
