"""DeepSpeed's own pipeline over hf_layer_specs trains a Hugging Face model exactly as pipezero's does.

bench/hf.py's `deepspeed-pipe` peer hands DeepSpeed's PipelineModule our specs turned into its
LayerSpecs (deepspeed_layer_specs). Both pipelines load the same save_pretrained directory,
cut the layers at the same place (2 stages) and run 1F1B over 4 micro-batches with AdamW;
DeepSpeed's losses (train_batch) and final parameters must equal pipezero's: the peer row of
the benchmark measures the same training, and the stage interface of hf_layer_specs (hidden,
position ids) works in DeepSpeed's engine as it does in ours. DeepSpeed is a test-only
dependency; on CPU its TorchBackend would first compile a shared-memory all-reduce kernel
(minutes) that gloo does not need, so that one builder is switched off here, in workers
that stop afterwards (DeepSpeed's pipeline also leaves its grid as a global for later engines).
"""

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
deepspeed = pytest.importorskip("deepspeed")

from harness import run  # noqa: E402
from test_hf import BATCH, LR, STEPS, _batch, _checkpoint  # noqa: E402


def _losses_and_params(engine_step, module) -> tuple[list[float], dict[str, torch.Tensor]]:
    from pipezero.pipe.hf import hf_state_dict

    losses = [engine_step(step) for step in range(STEPS)]
    return losses, {name: t.clone() for name, t in hf_state_dict(module).items()}


def _deepspeed(path: str):
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    from bench.hf import deepspeed_layer_specs
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs

    # gloo on CPU: no shared-memory kernel to compile. Patched in sys.modules: the attribute
    # deepspeed.comm.torch is the torch package itself (deepspeed.comm re-exports it), so
    # `import deepspeed.comm.torch as m` would patch torch and DeepSpeed would still compile.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    assert sys.modules["deepspeed.comm.comm"].cdb.shm_comm_op is None, "DeepSpeed built its shm kernel"
    model = DSPipelineModule(layers=deepspeed_layer_specs(hf_layer_specs(path)), num_stages=2,
                             loss_fn=causal_lm_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": BATCH // 4, "gradient_accumulation_steps": 4,
              "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(i: int) -> float:
        ids, targets = _batch(i)
        return engine.train_batch(data_iter=iter(zip(ids.chunk(4), targets.chunk(4)))).item()
    return model.parts, _losses_and_params(step, model)


def _pipezero(path: str):
    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.topology import Grid

    model = PipelineModule(hf_layer_specs(path), grid=Grid(pipe=2), loss_fn=causal_lm_loss,
                           partition_method="uniform")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    runner = PipelineRunner(model, OneFOneB(num_microbatches=4), optimizer=opt)

    def step(i: int) -> float:
        loss = runner.train_step(*_batch(i)).item()
        opt.step()
        opt.zero_grad()
        return loss
    return model.bounds, _losses_and_params(step, model)


def test_deepspeed_pipeline_over_hf_layer_specs_equals_ours(tmp_path_factory):
    path = _checkpoint("llama", str(tmp_path_factory.getbasetemp()))
    ours = run(_pipezero, 2, path, timeout=300)
    theirs = run(_deepspeed, 2, path, timeout=300, discard=True)  # DeepSpeed's globals stay in its workers
    for (ds_cut, (ds_losses, ds_params)), (cut, (losses, params)) in zip(theirs, ours):
        assert list(ds_cut) == list(cut), (ds_cut, cut)
        torch.testing.assert_close(ds_losses, losses, rtol=1e-6, atol=1e-6)
        assert ds_params.keys() == params.keys()
        for name, value in params.items():
            torch.testing.assert_close(ds_params[name], value, rtol=1e-6, atol=1e-6, msg=name)
