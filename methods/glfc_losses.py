"""GLFC's client loss terms (Dong et al., CVPR 2022, eq. 1-5; :mod:`fcl_emu.methods.glfc` describes the method): the
class-aware gradient compensation and the class-semantic relation distillation, in the paper's form or the
official code's (``loss_form``), and what the paper's ablations put in their place: the plain BCE (w/o CGC) and
iCaRL's distillation (w/o CRD)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compensation_weights(g: torch.Tensor, is_old: torch.Tensor) -> torch.Tensor:
    """Eq. 3: ``G_i`` over the mean ``G`` of its group (old / new classes); all ones without old samples'
    classes known (``is_old`` is None)."""
    g = g.detach()
    w = torch.ones_like(g)
    if is_old is None:
        return w
    for group in (is_old, ~is_old):
        if group.any():
            w[group] = g[group] / g[group].mean().clamp_min(1e-12)
    return w


def class_bce(logits: torch.Tensor, target: torch.Tensor, form: str = "paper") -> torch.Tensor:
    """Per sample, the binary cross-entropy of the sigmoid probabilities against ``target`` (the paper's
    ``D_BCE``): summed over the classes (``form = "paper"``) or averaged over them (``"code"``: 1/K of it)."""
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    return bce.sum(dim=1) if form == "paper" else bce.mean(dim=1)


def true_class_gradient(logits: torch.Tensor, y: torch.Tensor, form: str = "paper") -> torch.Tensor:
    """Eq. 2's ``G_i = |P_{i,y_i} - 1|``: with the softmax probability of the true class (``form = "paper"``)
    or its sigmoid probability (``"code"``: the gradient of the binary cross-entropy at the true logit)."""
    if form == "paper":
        p = torch.softmax(logits, dim=1).gather(1, y[:, None]).squeeze(1)
    else:
        p = torch.sigmoid(logits.gather(1, y[:, None]).squeeze(1))
    return (p - 1).abs()


def gradient_compensation_loss(logits: torch.Tensor, y: torch.Tensor, is_old: torch.Tensor | None,
                               form: str = "paper") -> torch.Tensor:
    """Eq. 1-4, ``L_GC = mean_i w_i D_BCE(sigmoid(z_i), y_i)``, ``w_i`` from :func:`true_class_gradient`
    (``is_old``: which samples belong to the client's old classes; None when it has none)."""
    w = compensation_weights(true_class_gradient(logits, y, form), is_old)
    return (w * class_bce(logits, F.one_hot(y, logits.shape[1]).float(), form)).mean()


def plain_bce_loss(logits: torch.Tensor, y: torch.Tensor, form: str = "paper") -> torch.Tensor:
    """The "w/o CGC" ablation's classification loss: eq. 1's :func:`class_bce` against the one-hot label with every
    sample's weight 1, averaged over the batch."""
    return class_bce(logits, F.one_hot(y, logits.shape[1]).float(), form).mean()


def icarl_distillation(logits: torch.Tensor, old_logits: torch.Tensor, form: str = "paper") -> torch.Tensor:
    """iCaRL's distillation (Rebuffi et al., CVPR 2017), what the "w/o CRD" ablation puts in eq. 5's place: the
    binary cross-entropy of the student's sigmoid outputs on the old model's ``K_old`` classes (the first ones)
    against the old model's sigmoid outputs as soft targets, summed over those classes (``form = "paper"``) or
    divided by the student's ``K`` classes (``"code"``: 1/K, as every code-form term), averaged over the batch."""
    k_old = old_logits.shape[1]
    bce = F.binary_cross_entropy_with_logits(logits[:, :k_old], torch.sigmoid(old_logits), reduction="none")
    per_sample = bce.sum(dim=1) if form == "paper" else bce.sum(dim=1) / logits.shape[1]
    return per_sample.mean()


def relation_distillation(logits: torch.Tensor, old_logits: torch.Tensor, y: torch.Tensor,
                          form: str = "paper") -> torch.Tensor:
    """Eq. 5, ``L_RD``: the target is the one-hot label whose old-class entries are the old model's sigmoid
    outputs (``old_logits``, over its ``K_old`` classes, the first ones). Paper: the KL divergence of the
    target from the sigmoid probabilities, class by class (each a Bernoulli), summed over the classes and
    averaged over the batch; code: their binary cross-entropy averaged over every entry (the same gradient
    divided by K, plus the target's entropy)."""
    target = F.one_hot(y, logits.shape[1]).float()
    target[:, :old_logits.shape[1]] = torch.sigmoid(old_logits)
    if form == "code":
        return class_bce(logits, target, "code").mean()
    entropy = F.binary_cross_entropy(target, target, reduction="none").sum(dim=1)
    return (class_bce(logits, target, "paper") - entropy).mean()
