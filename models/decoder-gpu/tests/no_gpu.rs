//! Runs everywhere (CI has no GPU): building the GPU model or decoder without an NVIDIA driver is
//! a typed error, not a panic.

use lifecycle_cuda::{driver_present, CudaError};
use lifecycle_decoder::{random_tensors, ModelConfig};
use lifecycle_decoder_gpu::{GpuDecodeError, GpuModel};

fn config() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0}"#,
    )
    .unwrap()
}

#[test]
fn constructing_without_a_gpu_is_a_typed_error() {
    let config = config();
    for tp in [1, 2] {
        let result = GpuModel::from_tensors(&config, random_tensors(&config, 1), tp);
        if driver_present() {
            // a GPU machine: success, or a typed error (e.g. too few GPUs for T = 2)
            if let Err(e) = result {
                assert!(matches!(e, GpuDecodeError::Cuda(_)), "{e:?}");
            }
            continue;
        }
        match result {
            Err(GpuDecodeError::Cuda(CudaError::NoDriver)) => {}
            other => panic!("expected Cuda(NoDriver), got {other:?}"),
        }
        let msg = GpuModel::synthetic(&config, tp, 1, 0.1)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
    }
}

#[test]
fn a_degree_the_model_cannot_split_at_is_a_typed_error_before_any_gpu_work() {
    // 4 heads do not split over T = 3: the layout is refused before the pool starts
    let config = config();
    match GpuModel::from_tensors(&config, random_tensors(&config, 1), 3) {
        Err(GpuDecodeError::Decode(e)) => assert!(e.to_string().contains("T = 3"), "{e}"),
        other => panic!("expected a Decode error, got {other:?}"),
    }
}

#[test]
fn unsupported_topologies_are_typed_errors_before_any_gpu_work() {
    let config = config();
    // two TP groups of 2: not supported
    match GpuModel::from_tensors_on(&config, random_tensors(&config, 1), 4, 2) {
        Err(GpuDecodeError::Topology { world, tp, reason }) => {
            assert_eq!((world, tp), (4, 2));
            assert!(reason.contains("not supported"), "{reason}");
        }
        other => panic!("expected Topology, got {other:?}"),
    }
    // T larger than W
    match GpuModel::from_tensors_on(&config, random_tensors(&config, 1), 1, 2) {
        Err(GpuDecodeError::Topology { .. }) => {}
        other => panic!("expected Topology, got {other:?}"),
    }
}

#[test]
fn building_the_engine_without_a_gpu_is_a_typed_error() {
    use lifecycle_decoder_gpu::{EngineSettings, GpuEngine};
    let config = config();
    if driver_present() {
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
