"""What a run leaves behind: records (:mod:`.records`), results folders (:mod:`.folders`), the
summary table (:mod:`.summary`), intervals (:mod:`.stats`), comparisons (:mod:`.compare`, :mod:`.agreement`).
"""
