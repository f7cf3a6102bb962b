"""Training: the LM run on the standard library (corpus, lm, guard, state, cli; docs/design.md §9), and
small CPU runs that demonstrate one mechanism each (balance, indexer)."""
from latentmoe_lab.training.balance import (MODES, BalanceHistory, balance_config, compare_balancing, skewed_batches,
                                            train_balancing)
from latentmoe_lab.training.corpus import Corpus, load_corpus
from latentmoe_lab.training.guard import NonFiniteError, NonFiniteGuard
from latentmoe_lab.training.indexer import (IndexerHistory, indexer_kl_loss, indexer_scores_and_target, peaked_layer,
                                            synthetic_hidden_states, topk_recall, train_indexer)
from latentmoe_lab.training.lm import History, TrainSettings, train

__all__ = ["MODES", "BalanceHistory", "balance_config", "compare_balancing", "skewed_batches", "train_balancing",
           "IndexerHistory", "indexer_kl_loss", "indexer_scores_and_target", "peaked_layer", "synthetic_hidden_states",
           "topk_recall", "train_indexer", "Corpus", "load_corpus", "NonFiniteError", "NonFiniteGuard", "History",
           "TrainSettings", "train"]
