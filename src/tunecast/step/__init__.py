"""What a training step is, below both the estimator and the runner: `estimate/` traces these modules and
`train/` runs them, so what is estimated is what runs.

* `settings`: the settings that describe a step (`TraceSettings`, from a RunSpec) and the ways other tools' steps
  differ from tunecast's (`STEP_VARIANTS`);
* `setup`: how a RunSpec becomes the model that trains (precision, LoRA through peft, QLoRA, checkpointing);
* `targets`: the LoRA target check against the model's modules;
* `forward`: one micro-batch's forward and backward pass;
* `loss`: the causal-LM loss and the loss variants of other tools.
"""
