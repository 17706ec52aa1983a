"""`sim2real/QuadrotorGeofence-v0` (being written)."""

ENV_ID = "sim2real/QuadrotorGeofence-v0"
TASK_NAME = "quadrotor"
CONTROL_PERIOD = 0.02
EPISODE_STEPS = 1000
OBS_DIM = 15
ACT_DIM = 3
MAX_ACCEL = (4.0, 4.0, 4.0)
ACCEL_TIME_CONSTANT = 0.05
SAFETY = {"kinematics": {"position_index": [0, 1, 2], "velocity_index": [3, 4, 5]}, "constraints": []}


class QuadrotorGeofenceEnv:
    def __init__(self, **kwargs):
        raise NotImplementedError("the quadrotor task is not written yet")
