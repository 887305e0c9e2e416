"""Direct alignment (offline preference) losses, chosen by name from the registry `LOSSES`.

The package: `base` (the shared input checks, scores and metrics, `LOSSES`), `pairwise` (the
DPO family, IPO, hinge, SimPO, ORPO) and `anchored` (KTO and APO, which anchor each response's
score to a reference point instead of only the pair's margin). Importing the package registers
every loss.

Every loss reads one preference pair per row: a chosen and a rejected completion of one prompt,
given as per-sequence *summed* completion log-probs of shape (B,) under the policy and, for most
losses, a frozen reference model, plus completion token counts (B,) where a loss averages:

    pc, pr = log pi(y_c | x),     log pi(y_r | x)        policy_chosen_logps, policy_rejected_logps
    rc, rr = log pi_ref(y_c | x), log pi_ref(y_r | x)    ref_chosen_logps, ref_rejected_logps
    h      = (pc - rc) - (pr - rr)                       the DPO log-ratio margin
    avg    = sum / length                                per-token average, length = chosen_lengths
                                                         or rejected_lengths

    name      per-pair loss                                              reference  lengths
    dpo       -logsig(beta h)                                            yes        no
    rpo       -logsig(beta h) + alpha (-pc / length_c)                   yes        yes (NLL)
    cdpo      -(1 - eps) logsig(beta h) - eps logsig(-beta h)            yes        no
    robust    [(1 - eps)(-logsig(beta h)) - eps(-logsig(-beta h))]
              / (1 - 2 eps)                                              yes        no
    ipo       (h - 1 / (2 beta))^2  (averages with length_normalize)     yes        optional
    hinge     relu(1 - beta h)                                           yes        no
    simpo     -logsig(beta (avg_c - avg_r) - gamma)                      no         yes
    orpo      -avg_c - beta logsig(log_odds(avg_c) - log_odds(avg_r))    no         yes
    kto       batch-level reference point z, see `KTOPairLoss`           yes        no
    kto_unpaired  unpaired rows with labels, see `KTOLoss`                 yes        no
    apo_zero  (1 - sigmoid(beta (pc - rc))) + sigmoid(beta (pr - rr))    yes        no
    apo_down  sigmoid(beta (pc - rc)) + (1 - sigmoid(beta h))            yes        no

Calling `loss_fn(pc, pr, rc, rr, chosen_lengths=..., rejected_lengths=...)` returns
`(loss, metrics)`: `loss` is the batch mean of the per-pair losses (KTO: of its 2B per-response
terms) and `metrics` holds detached scalar tensors (no device sync): rewards/chosen,
rewards/rejected, rewards/margin, rewards/accuracy, logps/chosen, logps/rejected, plus a few
loss-specific ones. The rewards are beta times the per-response score the loss works on:
beta (pc - rc) for reference-based losses (per-token averages for `ipo` with length_normalize),
beta avg for the reference-free `simpo` and `orpo`. Everything is computed in the input dtype;
all log-prob tensors must share one floating dtype, and lengths are cast to it.

Not here: computing the log-probs (`rlhf_core.logprobs`), SLiC-HF's regulariser, sorted (AOT)
or running-mean (BCO) variants, f-divergence DPO, and a cross-process estimate of KTO's
reference point (it is the local batch mean). Lengths are not checked for being >= 1 (that
would need a device sync): a zero length gives a non-finite loss, which the train loop counts
and skips.
"""

from direct_alignment.losses.anchored import (
    APODownLoss,
    APOZeroLoss,
    KTOLoss,
    KTOPairLoss,
)
from direct_alignment.losses.base import (
    LOSSES,
    ORPO_MAX_AVG_LOGP,
    DirectAlignmentLoss,
    log1mexp,
    loss_inputs,
)
from direct_alignment.losses.pairwise import (
    ConservativeDPOLoss,
    DPOLoss,
    HingeLoss,
    IPOLoss,
    NoisyLabelLoss,
    ORPOLoss,
    RobustDPOLoss,
    RPOLoss,
    SimPOLoss,
)

__all__ = [
    "LOSSES",
    "ORPO_MAX_AVG_LOGP",
    "APODownLoss",
    "APOZeroLoss",
    "ConservativeDPOLoss",
    "DPOLoss",
    "DirectAlignmentLoss",
    "HingeLoss",
    "IPOLoss",
    "KTOLoss",
    "KTOPairLoss",
    "NoisyLabelLoss",
    "ORPOLoss",
    "RPOLoss",
    "RobustDPOLoss",
    "SimPOLoss",
    "log1mexp",
    "loss_inputs",
]
