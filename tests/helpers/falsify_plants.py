"""Test plants for the falsification search: the shipped cart-pole with an envelope of many randomized parameters."""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[2]
BALLAST = 6  # ballast blocks bolted to the cart, each with its own randomized mass


def ballast_cartpole(folder: Path):
    """The cart-pole carrying BALLAST blocks, every mass, damping and gain randomized: 12 parameters per set, 4,096
    corners each (the shipped cart-pole has 6). Written to `folder`, loaded as a declared plant."""
    xml = (ROOT / "configs" / "cartpole_rail.xml").read_text()
    blocks = "".join(
        f'\n      <body name="ballast{i}" pos="{0.08 * (i - 2.5):.2f} 0 -0.07">'
        f'<geom name="ballast{i}" type="box" size="0.03 0.03 0.02" mass="0.05" contype="0" '
        f'conaffinity="0"/></body>'
        for i in range(BALLAST)
    )
    anchor = '<body name="pole" pos="0 0 0">'
    assert anchor in xml
    (folder / "ballast_cartpole.xml").write_text(xml.replace(anchor, blocks.lstrip("\n ") + "\n      " + anchor, 1))
    doc = yaml.safe_load((ROOT / "configs" / "cartpole.yaml").read_text())
    doc["task"] = {"name": "ballast_cartpole", "env_id": "sim2real/BallastCartpole-v0"}
    doc["plant"]["mjcf"] = "ballast_cartpole.xml"
    for rset in doc["randomization"].values():
        rset["body_mass"].update({f"ballast{i}": {"dist": "uniform", "low": 0.5, "high": 2.0} for i in range(BALLAST)})
        rset["gravity_scale"] = {"dist": "uniform", "low": 0.98, "high": 1.02}
    path = folder / "ballast_cartpole.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_config(path)
