//! Runs everywhere (CI has no GPU): building a [`GpuModel`] without an NVIDIA driver is a typed
//! error, not a panic; bad degrees and topologies are refused before any GPU work.

use lifecycle_cuda::{driver_present, CudaError};
use lifecycle_decoder::{random_tensors, ModelConfig};
use lifecycle_decoder_gpu::GpuDecodeError;
use lifecycle_examples::gpu_model::{GpuModel, GpuModelError};

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
                assert!(matches!(e, GpuModelError::Cuda(_)), "{e:?}");
            }
            continue;
        }
        match result {
            Err(GpuModelError::Cuda(CudaError::NoDriver)) => {}
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
        Err(GpuModelError::Decode(e)) => assert!(e.to_string().contains("T = 3"), "{e}"),
        other => panic!("expected a Decode error, got {other:?}"),
    }
}

#[test]
fn unsupported_topologies_are_typed_errors_before_any_gpu_work() {
    let config = config();
    // two TP groups of 2: not supported
    match GpuModel::from_tensors_on(&config, random_tensors(&config, 1), 4, 2) {
        Err(GpuModelError::Gpu(GpuDecodeError::Topology { world, tp, reason })) => {
            assert_eq!((world, tp), (4, 2));
            assert!(reason.contains("not supported"), "{reason}");
        }
        other => panic!("expected Topology, got {other:?}"),
    }
    // T larger than W
    match GpuModel::from_tensors_on(&config, random_tensors(&config, 1), 1, 2) {
        Err(GpuModelError::Gpu(GpuDecodeError::Topology { .. })) => {}
        other => panic!("expected Topology, got {other:?}"),
    }
}
