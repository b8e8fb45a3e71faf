"""The on-disk graph-set format: reading a set (:mod:`.reader`), writing one (:mod:`.writer`) and the caches
made from it (:mod:`.cache`)."""
