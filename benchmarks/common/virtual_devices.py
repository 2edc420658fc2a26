"""Virtual CPU devices: asking XLA for several before JAX starts.

JAX fixes its device count when it starts. A script that runs on 8 virtual
CPU devices (``pipeline``, ``sharding``) puts
``--xla_force_host_platform_device_count=8`` into ``XLA_FLAGS`` before its
own ``import jax`` (:func:`ask_for`); a process whose JAX started with fewer
runs the script again in a child process given :func:`environment`.

Imports no JAX, so that a script can import it first.
"""

from __future__ import annotations

import os
import re

FLAG = "--xla_force_host_platform_device_count"


def xla_flags(flags: str, count: int) -> str:
  """``flags`` (a value of ``XLA_FLAGS``) asking for ``count`` CPU devices,
  in place of any count they asked for before."""
  flags = re.sub(rf"{FLAG}=\S+", "", flags)
  return f"{flags.strip()} {FLAG}={count}".strip()


def ask_for(count: int) -> None:
  """Asks XLA for ``count`` CPU devices (only effective before JAX is imported)."""
  os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), count)


def environment(count: int) -> dict[str, str]:
  """This process's environment, XLA asked for ``count`` CPU devices: for a
  child process."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = xla_flags(env.get("XLA_FLAGS", ""), count)
  return env
