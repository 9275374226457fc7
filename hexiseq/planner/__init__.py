"""The planner's front: the cluster and the model as the user describes them, and the plan the C core chooses for
them (and its text). The calibration and measurement that tie its predictions to real hardware live above it, in
hexiseq/hardware/."""
