"""The ladder's options that change how torch.compile builds the step, checked for their math before their timing
means anything: one compiled training step's gradients against the same step run eagerly, on the GPU's PyTorch.

In float32 (TF32 off) and with dropout off, the two compute the same sums in other orders, so they agree to about
1e-6 of each gradient's largest entry. On PyTorch 2.14.1 on a CPU (2026-11-26), Inductor with
torch.compiler.nested_compile_region around the transformer block gave the right loss but gradients up to half their
size off, from two blocks on, where the same region under the aot_eager backend gave them exactly; with
torch._inductor.config.allow_buffer_reuse = False they were exact (6.8e-7) again, so --option nested-compile-region
sets both. This file asks the same of the GPU at hand, with the options switched on as the ladder switches them; a
failure says the option must not be timed, let alone kept.

Budget on one H100: about 1 minute (two compilations of the tiny model).
"""

import pytest
import torch

from test_ladder import ALLOWED, worst_gradient_error  # the CPU suite runs it for the option, on the CPU


@pytest.mark.parametrize("options", [(), ("nested-compile-region",)], ids=["as-01", "nested-compile-region"])
def test_the_compiled_step_gives_the_eager_gradients(options, report):  # budget: ~30 s each
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(allow_buffer_reuse=inductor_config.allow_buffer_reuse):  # restored after
        eager_loss, compiled_loss, error, name = worst_gradient_error(options, torch.device("cuda"))
    label = "01's compiled step" + "".join(f" with --option {option}" for option in options)
    report(f"{label}, tiny, float32, no dropout: loss {compiled_loss:.6f} (eager {eager_loss:.6f}); largest gradient "
           f"difference {error:.2e} of its parameter's largest entry ({name}; allowed {ALLOWED:.0e})")
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    assert error <= ALLOWED, f"{label} trains another model: its gradients are not the eager step's ({name})"
