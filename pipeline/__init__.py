"""The pipeline: training (Ray + torch), deployment (ONNX export, registry), evaluation
(episodes, shadow, gate, reports) and the `sim2real` CLI. Sub-packages follow the data:
training -> deployment -> evaluation; `safety` (the shield as the pipeline builds it) and
`config` sit under all three, and `cli` is the only module that knows every wing.
"""

DEFAULT_CONFIG = "configs/cartpole.yaml"
"""The config every command uses when none is given."""
