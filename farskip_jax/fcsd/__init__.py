"""FCSD (FarSkip-Collective self-distillation): converting a trained model to FarSkip connectivity.

    source.py          where the weights come from (an HF folder or a run folder) -> teacher = student
    planner.py         farskip.layers: auto -- the converted-layer set chosen for a quality budget
    distill.py         the loss, the jitted step and the loop (teacher frozen, student trained)
    early_stopping.py  the early-stopping rule on the validation metric

It builds on model/, loading/ (train state, optimizer, checkpoints), train/ (run folders, the loop),
eval/ (the teacher/student comparison it early-stops on) and convert/ (the student's export); the
planner's command line is analysis/conversion_plan.py.
"""
