"""Training: `train.train(cfg)` runs the algorithm `train.algorithm` names.

algorithms.py is the one table (name -> config model, loop, deployable policy); scaffold.py what every loop
shares and the `TrainResult` they return; onpolicy.py (IMPALA, APPO: learner.py, vtrace.py) and offpolicy.py
(SAC, TD3: sac.py, td3.py, replay.py) the loops; rollout.py, actor_pool.py, selection.py, checkpoint.py,
metrics.py and nets.py their parts; policy.py rebuilds a run's deployable policy for export.
"""
