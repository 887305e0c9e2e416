"""direct_alignment: offline preference optimisation (DPO, cDPO, robust DPO, IPO, hinge/SLiC,
SimPO, ORPO, KTO, APO).

    config.py     `DAConfig`, the YAML schema (a `models:` list trains several policies)
    data.py       preference pairs -> one concatenated chosen+rejected batch (its collate)
    reference.py  sequence log-probs of a batch for the policy and the reference
    losses.py     the losses, each reading like its paper (registry `LOSSES`)
    evaluate.py   held-out reward accuracy and margins, sampled generations
    train.py      `train(cfg)`, the loop, read top to bottom

Run: `uv run python -m direct_alignment.train --config configs/direct_alignment/tiny_dpo.yaml`
"""
