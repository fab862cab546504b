"""The layers a call runs through: the attention layers (:mod:`.attention`, :mod:`.mla`,
:mod:`.kv_sharing`), what they read (:mod:`.inputs`, :mod:`.positions`), the decode
steps (:mod:`.decode`, :mod:`.plain_step`) and the models built from them (:mod:`.model`, :mod:`.patterns`).
"""
