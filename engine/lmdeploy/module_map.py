"""weightsync's custom module map for LMDeploy: give this file's path (MODULE_MAP_PATH) as
`custom_module_map`. LMDeploy reads it in every model agent (its own SourceFileLoader, by path)
and builds the classes named here in place of its own: LMDeploy's classes whose load_weights also
takes weightsync's request (models.py). Architectures not listed keep LMDeploy's classes; they
still load from the store in process (pipeline.py), but no LMDeploy route can carry the request
to them. Plain data: LMDeploy loads the file outside the package.
"""

MODULE_MAP = {
    arch: f"weightsync.engine.lmdeploy.models.{arch}"
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
}
