"""The planner's front: the cluster and the model as the user describes them, the plan the C core chooses for them
(and its text), and the calibration and measurement that tie the core's predictions to real hardware."""
