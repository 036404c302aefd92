//! Runs everywhere (CI has no GPU): building the GPU decoder's engine without an NVIDIA driver is
//! a typed error, not a panic.

use lifecycle_cuda::CudaError;
use lifecycle_decoder::ModelConfig;

fn config() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0}"#,
    )
    .unwrap()
}

#[test]
fn building_the_engine_without_a_gpu_is_a_typed_error() {
    use lifecycle_decoder_gpu::{EngineSettings, GpuEngine};
    let config = config();
    if lifecycle_cuda::driver_present() {
        return;
    }
    // no driver: the pool cannot start, so the engine is never reached; the settings are
    // checked first, before any GPU work, by the engine itself
    let bad = EngineSettings::new(0, 8).check().unwrap_err().to_string();
    assert!(bad.contains("at least 1"), "{bad}");
    match lifecycle_cuda::ThreadRankPool::new(1) {
        Err(CudaError::NoDriver) => {}
        Ok(pool) => {
            let layout = config.rollout_layout(1).unwrap();
            let r = GpuEngine::new(
                std::sync::Arc::new(pool),
                &config,
                layout,
                EngineSettings::new(1, 8),
            );
            assert!(r.is_err());
        }
        Err(other) => panic!("expected NoDriver, got {other:?}"),
    }
}
