"""Does a backward differentiate the forward that ran? A check for compiled graphs with dropout.

A compiled graph may draw a dropout mask again in its backward instead of keeping it (Inductor does under activation
checkpointing: it keeps the mask's seed). If the mask drawn again is not the forward's, the gradients belong to
another network, and training goes on without an error. pytorch/pytorch#198333 reports such a case on CUDA since
PyTorch 2.13: Inductor draws a kernel's random numbers by one of two formulas, picked by whether the generated kernel
is 1-D or tiled, so a forward kernel and the backward kernel that draws its mask again need not draw alike.

The check needs no second graph to compare with. The backward gives the gradient g of the loss L; along one random
unit direction v of the weights w, g . v is compared with the central difference (L(w + eps v) - L(w - eps v)) /
(2 eps) of the same graph's loss, each forward reseeded so that it draws the masks of the first. With the masks
matched, the two agree up to rounding and a term in eps squared; a backward with other masks gives the gradient of
another network. The control takes the difference with masks drawn from another seed: what a backward with wrong
masks would be measured against, which shows that the check can fail at the shapes given.

What it cannot see: a forward whose masks are themselves wrong (the issue's other symptom, groups of four channels
dropped alike), as long as the backward uses the same ones.
"""

import torch


def directional_derivatives(loss_of, weights, eps, seed=1, other_seed=2):
    """(g . v from the backward, the central difference with the forward's masks, the same with other masks).

    `loss_of()` runs the forward and returns a scalar, drawing its dropout from PyTorch's global random state; every
    weight in `weights` must take part. v is a random unit vector over all the weights, the same on every call. A
    compiled `loss_of` must not compile again for the perturbed weights (it would draw its masks anew): that fails."""
    torch.manual_seed(seed)
    for weight in weights:
        weight.grad = None
    loss_of().backward()
    generator = torch.Generator().manual_seed(0)
    direction = [torch.randn(weight.shape, generator=generator).to(weight.device) for weight in weights]
    norm = torch.sqrt(sum((part.double() ** 2).sum() for part in direction))
    direction = [part / norm.to(part.dtype) for part in direction]
    from_backward = sum((weight.grad.double() * part).sum() for weight, part in zip(weights, direction)).item()

    def central_difference(draw_from):
        values = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for weight, part in zip(weights, direction):
                    weight.add_(part, alpha=sign * eps)
            torch.manual_seed(draw_from)
            with torch.compiler.set_stance("fail_on_recompile"):
                values.append(loss_of().item())  # gradients on: the training graph, not an inference one
            with torch.no_grad():
                for weight, part in zip(weights, direction):
                    weight.sub_(part, alpha=sign * eps)
        return (values[0] - values[1]) / (2 * eps)

    return from_backward, central_difference(seed), central_difference(other_seed)


def relative_errors(loss_of, weights, eps, seed=1, other_seed=2):
    """(error, control): how far the backward's g . v is from the central difference with the forward's masks, and
    from the one with other masks, relative to g . v."""
    from_backward, same_masks, other_masks = directional_derivatives(loss_of, weights, eps, seed, other_seed)
    return abs(from_backward - same_masks) / abs(from_backward), abs(from_backward - other_masks) / abs(from_backward)
