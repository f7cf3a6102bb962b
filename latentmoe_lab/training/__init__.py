"""Small CPU training runs that demonstrate one mechanism each."""
from latentmoe_lab.training.balance import (MODES, BalanceHistory, balance_config, compare_balancing, skewed_batches,
                                            train_balancing)
from latentmoe_lab.training.indexer import (IndexerHistory, indexer_kl_loss, indexer_scores_and_target, peaked_layer,
                                            synthetic_hidden_states, topk_recall, train_indexer)

__all__ = ["MODES", "BalanceHistory", "balance_config", "compare_balancing", "skewed_batches", "train_balancing",
           "IndexerHistory", "indexer_kl_loss", "indexer_scores_and_target", "peaked_layer", "synthetic_hidden_states",
           "topk_recall", "train_indexer"]
