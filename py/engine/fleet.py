"""The instances and routers one real-engine run keeps up, changed only as
the next case needs.

Owns: which ``vllm serve`` processes run now (by role: "p", "d", "ref",
"p_stock", ...), the swap to another set (stop what is not wanted, start what is missing, in
parallel), the routers in front of the current P and D, and the per-case
record of crashes (an instance that exited without being asked). May not
judge a case.

Why swaps and not a fresh pair per case: an instance takes 30-50 s to start
on 2 cores, and the step takes about 25 minutes as it is (the gate of
80dec0e: 1,547 s). Cases are ordered so that consecutive ones share
instances (``test_real_engine.py``).
"""

from __future__ import annotations

from pathlib import Path

from instances import Instance, InstanceSpec, start_all
from routers import RouterProcess


class Fleet:
    def __init__(self, model: str, logs: Path) -> None:
        self.model = model
        self.logs = logs
        self.running: dict[str, Instance] = {}
        self.routers: dict[tuple[str, str, str], RouterProcess] = {}
        #: Instances that died without being stopped or killed by a case.
        self.crashes: list[str] = []
        self._expected_dead: set[int] = set()

    def ensure(self, **specs: InstanceSpec | None) -> dict[str, Instance]:
        """Makes the running set exactly ``specs`` (role -> spec; None stops
        the role). An instance whose spec is unchanged keeps running."""
        self.check_crashes()
        stop = [r for r, inst in self.running.items()
                if r in specs and (specs[r] is None or specs[r] != inst.spec)]
        for role in stop:
            self.stop(role)
        wanted = {r: s for r, s in specs.items() if s is not None and r not in self.running}
        if wanted:
            self._stop_routers()
            started = start_all(list(wanted.values()), self.model, self.logs)
            self.running.update(zip(wanted.keys(), started))
        return self.running

    def only(self, **specs: InstanceSpec) -> dict[str, Instance]:
        """Makes the running set exactly ``specs``: every other role stops."""
        return self.ensure(**{r: None for r in self.running if r not in specs}, **specs)

    def stop(self, role: str) -> None:
        self._stop_routers()
        inst = self.running.pop(role, None)
        if inst is not None:
            self._expected_dead.add(id(inst))
            inst.stop()

    def kill(self, role: str) -> Instance:
        """SIGKILLs the whole instance (a crashed host); it leaves the set."""
        inst = self.running.pop(role)
        self._expected_dead.add(id(inst))
        inst.kill()
        return inst

    def router(self, kind: str, p: str | tuple[str, ...] = "p",
               d: str | tuple[str, ...] = "d") -> RouterProcess:
        """A router of ``kind`` ("toy" or "float64") in front of the running
        instances of roles ``p`` and ``d`` (a role, or several: the router
        takes turns among them); kept until an instance changes."""
        ps = (p,) if isinstance(p, str) else tuple(p)
        ds = (d,) if isinstance(d, str) else tuple(d)
        key = (kind, ps, ds)
        r = self.routers.get(key)
        if r is None:
            r = RouterProcess(kind, [self.running[x] for x in ps], [self.running[x] for x in ds],
                              self.logs).start()
            self.routers[key] = r
        return r

    def _stop_routers(self) -> None:
        for r in self.routers.values():
            r.stop()
        self.routers.clear()

    def check_crashes(self) -> list[str]:
        """Names of running instances that died on their own (recorded)."""
        dead = [f"{role} ({inst.spec.name}): exit {inst.proc.returncode if inst.proc else '?'}"
                for role, inst in self.running.items() if not inst.alive()]
        for line in dead:
            if line not in self.crashes:
                self.crashes.append(line)
        return dead

    def close(self) -> None:
        self._stop_routers()
        for role in list(self.running):
            self.stop(role)
