"""FCSD (FarSkip-Collective self-distillation): converting a trained model to FarSkip connectivity.

    source.py          where the weights come from (an HF folder or a run folder) -> teacher = student
    planner.py         farskip.layers: auto -- the converted-layer set chosen for a quality budget
    distill.py         the loss, the jitted step and the loop (teacher frozen, student trained)
    early_stopping.py  the early-stopping rule on the validation metric

It builds on model/, train/ (train state, optimizer, checkpoints, run folders) and eval/ (the
teacher/student comparison it early-stops on); nothing outside this package imports train code from it.
"""
