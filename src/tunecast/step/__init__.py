"""What a training step is, below both the estimator and the runner: `estimate/` traces these modules and
`train/` runs them, so what is estimated is what runs.

* `shape`: the model's architecture, built from its config (on the meta device for an estimate);
* `settings`: the settings that describe a step (`TraceSettings`, from a RunSpec), and its cache key;
* `variants`: the ways other tools' steps differ from tunecast's (`STEP_VARIANTS`), and which a config's runner runs;
* `setup`: how a RunSpec becomes the model that trains (precision, LoRA through peft, QLoRA, checkpointing);
* `targets`: the LoRA target check against the model's modules;
* `forward`: one micro-batch's forward and backward pass;
* `loss`: the causal-LM loss and the loss variants of other tools.
"""
