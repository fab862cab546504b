"""The layers a call runs through: the attention layers (:mod:`.attention`, :mod:`.mla`,
:mod:`.kv_sharing`), what they read (:mod:`.inputs`, :mod:`.positions`), the decode
step (:mod:`.step`: one plan and run for every call) and the models built from them (:mod:`.model`, :mod:`.patterns`).
"""
