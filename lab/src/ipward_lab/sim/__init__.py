from ipward_lab.sim.soak import FAULTS, NS, POOL, Options, Soak, sim_command

__all__ = ["FAULTS", "NS", "POOL", "Options", "Soak", "sim_command"]
