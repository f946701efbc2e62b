"""The model side: loading a checkpoint and its MTP head (`loader`,
`mtp_head`) and the engine's layers, installed on loaded instances in one
list (`install`)."""
