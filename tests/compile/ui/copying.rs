// Shared by the UI cases (`include!`d): a backend whose training state and rollout weights are
// the same `Vec<f32>`, copied on enter.

struct Copying;

impl lifecycle_core::Reshard for Copying {
    type TrainState = Vec<f32>;
    type Rollout = Vec<f32>;
    type Plan = ();
    type Error = std::io::Error;

    fn plan(&self, _: &Vec<f32>) -> std::io::Result<()> {
        Ok(())
    }
    fn enter(
        &mut self,
        _: &(),
        state: &mut Vec<f32>,
        _: &mut lifecycle_core::SwitchContext<'_>,
    ) -> std::io::Result<Vec<f32>> {
        Ok(state.clone())
    }
    fn refresh(
        &mut self,
        _: &(),
        state: &mut Vec<f32>,
        rollout: &mut Vec<f32>,
        _: &mut lifecycle_core::SwitchContext<'_>,
    ) -> std::io::Result<()> {
        rollout.clone_from(state);
        Ok(())
    }
    fn exit(
        &mut self,
        _: &mut Vec<f32>,
        _: Option<Vec<f32>>,
        _: &mut lifecycle_core::SwitchContext<'_>,
    ) -> std::io::Result<()> {
        Ok(())
    }
}

type LcResult<T = ()> = Result<T, lifecycle_core::LifecycleError<std::io::Error>>;
