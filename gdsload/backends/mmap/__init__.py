"""The mmap backend, the RAM tier (:mod:`.backend`): shard files mapped and locked in host memory, loaded in the
background at open (:mod:`.preload`), copied to the device by one native call per window (:mod:`.copier`).
Nothing is imported here, so a module of the room is imported alone."""
