"""Policy: the times and sizes that decide when addresses and blocks move, in one place
(the defaults of pool fields, CNI config fields and command options name these).

Standard library only, nothing imported: the plugin reads the grace and TTL defaults.
"""

from __future__ import annotations

# Seconds a record is never judged leaked after its ADD (docs/design.md 5.4): its sandbox may
# not be listed by the runtime yet.
ADD_GRACE = 120.0
# Seconds a detached sticky reservation of a pod with no StatefulSet is kept.
STICKY_TTL = 600.0
# Seconds before a freed address is handed out again (docs/design.md invariant 9), per pool.
DEFAULT_COOLDOWN = 30.0
# Free addresses the controller keeps on every node, per family, per pool.
DEFAULT_WARM = 16
# Seconds a surplus block stays empty before the controller asks it back.
DEFAULT_RELEASE_DELAY = 180.0
# A node with no block left to claim may take one address of another node's block: a
# pool then serves every node whatever its size, and as nodes are added (blocks sized
# for today's node count would not). A pool stored before this default kept its own.
DEFAULT_BORROW = True
# A block's hand-back compares each of its addresses absent in one etcd transaction,
# whose compares etcd caps at 128 by default: larger blocks are never asked back.
MAX_RELEASABLE_BLOCK = 128
# A lease (an agent's registration, the controller's leadership) is renewed this many
# times a TTL: two renewals may fail before it lapses.
KEEPALIVES_PER_TTL = 3
# Seconds an agent's registration lives unrenewed.
NODE_TTL = 10
# Seconds between puts of an agent's registration with its wall clock: judges measure
# each node's clock offset from it (a record's age is judged on the judge's clock), and
# an agent finding its registration gone puts it back then.
REGISTRATION_REFRESH = 60.0
# Seconds the wall clock may move against the monotonic one between two looks of the
# agent before it counts as a step: the registration is put again at once.
CLOCK_STEP = 1.0
# Seconds a node's clock may be off a judge's before it is reported (log, metric,
# `ipward status`); any offset is corrected for, this only says when it is worth a word.
CLOCK_SKEW_BOUND = 5.0
# Seconds between an agent's looks for its marked blocks: 3 reads at about one block a
# node, which 5,000 nodes make 3,000 a second on etcd (15,000 at 1 s). A hand-back is
# housekeeping: an answer up to this late delays only the block's return to the pool.
DUTY_INTERVAL = 5.0
