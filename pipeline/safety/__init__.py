"""The shield as the pipeline sees it: the config -> shield.json mapping and the shielded env."""
