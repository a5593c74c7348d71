# The benchmark shapes of the performance issue, shared by the scripts in scripts/bench/
# (sourced, not run): key=value overrides on top of configs/base.yml.
#   tiny   (host-bound)  D 64, 2 layers, seq 64, batch 4
#   small  (25M)         D 512, 8 layers, 8 heads (4 KV) of 64, MLP 1536, seq 256, batch 4
#   medium (104M)        D 768, 12 layers, 12 heads (4 KV) of 64, MLP 3072, seq 512, batch 1
#   1b     (974M)        D 2048, 16 layers, 32 heads (8 KV) of 64, MLP 8192, seq 128, batch 1
#   850m   (852M)        the 1b shape with 14 layers: the largest whose R=1 `none` and R=4
#                        `optim_grads_params` rows both fit the 23 GB CI machine kind
declare -A SHAPES=(
  [tiny]="override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=192 base_num_decoder_layers=2 max_target_length=64 per_device_batch_size=4"
  [small]="override_model_config=true base_emb_dim=512 base_num_query_heads=8 base_num_kv_heads=4 head_dim=64 base_mlp_dim=1536 base_num_decoder_layers=8 max_target_length=256 per_device_batch_size=4"
  [medium]="override_model_config=true base_emb_dim=768 base_num_query_heads=12 base_num_kv_heads=4 head_dim=64 base_mlp_dim=3072 base_num_decoder_layers=12 max_target_length=512 per_device_batch_size=1"
  [1b]="override_model_config=true base_emb_dim=2048 base_num_query_heads=32 base_num_kv_heads=8 head_dim=64 base_mlp_dim=8192 base_num_decoder_layers=16 max_target_length=128 per_device_batch_size=1"
  [850m]="override_model_config=true base_emb_dim=2048 base_num_query_heads=32 base_num_kv_heads=8 head_dim=64 base_mlp_dim=8192 base_num_decoder_layers=14 max_target_length=128 per_device_batch_size=1"
)
