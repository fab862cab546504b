"""The context-extension study of a pretrained HF model: its plan (:mod:`.plan`), the scaling
variants (:mod:`.hf_scaling`), the study itself (:mod:`.hf_study`) and the HF model evaluation (:mod:`.hf_eval`).
"""
